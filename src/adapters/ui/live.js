// statecore's live view. Plain JS, no library, no build: it fetches the node's machines
// (/ui/graph.json, the same edges the docs' diagrams draw), draws them as SVG, then follows
// /ui/events (server-sent events) to show how many requests are in each phase, the recent
// transitions and the rates. Every string from the node is set as text, never as markup
// (request ids are chosen by clients).
"use strict";

(() => {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const COL = 150, ROW = 64, W = 122, H = 40, PAD = 14, TOP = 30;
  const FLASH_MS = 900, TRANSITIONS_SHOWN = 200, SAMPLES_SHOWN = 120;

  const view = {
    role: "",
    boot: "",
    closing: false,
    requestMachine: "",
    phases: new Map(),   // "machine/phase" -> <g>
    edges: new Map(),    // "machine/source>target" -> <g>
    samples: [],
  };

  function svg(tag, attrs, parent) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (parent) parent.appendChild(node);
    return node;
  }

  function html(tag, text, parent) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    if (parent) parent.appendChild(node);
    return node;
  }

  // -- drawing a machine ---------------------------------------------------------------------

  function place(phase) {
    return { x: PAD + phase.rank * COL, y: TOP + phase.row * ROW };
  }

  function borderPoint(box, toward) {
    // where the line from the box's centre toward a point leaves the box
    const cx = box.x + W / 2, cy = box.y + H / 2;
    const dx = toward.x - cx, dy = toward.y - cy;
    if (dx === 0 && dy === 0) return { x: cx, y: cy };
    const t = Math.min(Math.abs((W / 2) / (dx || 1e-9)), Math.abs((H / 2) / (dy || 1e-9)));
    return { x: cx + dx * t, y: cy + dy * t };
  }

  function edgePath(from, to, bend) {
    if (from.x === to.x && from.y === to.y) {  // a self-loop above the box
      const x = from.x + W / 2, y = from.y;
      return `M ${x - 12} ${y} C ${x - 26} ${y - 26}, ${x + 26} ${y - 26}, ${x + 12} ${y}`;
    }
    const a = { x: from.x + W / 2, y: from.y + H / 2 }, b = { x: to.x + W / 2, y: to.y + H / 2 };
    const len = Math.hypot(b.x - a.x, b.y - a.y);
    const control = { x: (a.x + b.x) / 2 - ((b.y - a.y) / len) * bend,
                      y: (a.y + b.y) / 2 + ((b.x - a.x) / len) * bend };
    const start = borderPoint(from, control), end = borderPoint(to, control);
    return `M ${start.x} ${start.y} Q ${control.x} ${control.y} ${end.x} ${end.y}`;
  }

  function drawMachine(machine, parent) {
    const section = html("section", undefined, parent);
    section.className = "machine-box";
    html("h3", machine.title, section);
    const cols = Math.max(...machine.phases.map(p => p.rank)) + 1;
    const rows = Math.max(...machine.phases.map(p => p.row)) + 1;
    const width = PAD * 2 + (cols - 1) * COL + W, height = TOP + (rows - 1) * ROW + H + PAD;
    const root = svg("svg", { class: "machine", width, height, viewBox: `0 0 ${width} ${height}`,
                              "data-machine": machine.name }, section);
    const marker = svg("marker", { id: `arrow-${machine.name}`, viewBox: "0 0 10 10", refX: 9, refY: 5,
                                   markerWidth: 8, markerHeight: 8, markerUnits: "userSpaceOnUse",
                                   orient: "auto-start-reverse" },
                       svg("defs", {}, root));
    svg("path", { d: "M0,0 L10,5 L0,10 z", fill: "#999" }, marker);

    const byName = new Map(machine.phases.map(p => [p.name, p]));
    const pairs = new Set(machine.edges.map(e => `${e.source}>${e.target}`));
    const edgeLayer = svg("g", {}, root);
    for (const edge of machine.edges) {
      const source = byName.get(edge.source), target = byName.get(edge.target);
      const span = Math.abs(target.rank - source.rank);
      // edges both ways part; a long edge bows around the phases it passes
      let bend = pairs.has(`${edge.target}>${edge.source}`) ? 14 : 0;
      if (span > 1 && source.row === target.row) bend = -22 * (span - 1);
      const g = svg("g", { class: "edge" + (target.unsuccessful ? " failing" : "") }, edgeLayer);
      svg("path", { d: edgePath(place(source), place(target), bend),
                    "marker-end": `url(#arrow-${machine.name})` }, g);
      svg("title", {}, g).textContent = `${edge.source} → ${edge.target}\n` + edge.labels.join("\n");
      view.edges.set(`${machine.name}/${edge.source}>${edge.target}`, g);
    }
    for (const phase of machine.phases) {
      const at = place(phase);
      const g = svg("g", { class: "phase" + (phase.terminal ? " terminal" : ""),
                           "data-machine": machine.name, "data-phase": phase.name, "data-count": 0,
                           transform: `translate(${at.x} ${at.y})` }, root);
      svg("rect", { width: W, height: H, rx: 8 }, g);
      svg("text", { class: "name", x: W / 2, y: 16, "text-anchor": "middle" }, g).textContent = phase.name;
      svg("text", { class: "count", x: W / 2, y: 32, "text-anchor": "middle" }, g).textContent = "";
      view.phases.set(`${machine.name}/${phase.name}`, g);
    }
  }

  // -- applying a message ---------------------------------------------------------------------

  function setCount(machine, phase, count, words) {
    const g = view.phases.get(`${machine}/${phase}`);
    if (!g) return;
    g.setAttribute("data-count", String(count));
    g.querySelector(".count").textContent = words;
    g.classList.toggle("busy", count > 0 && !g.classList.contains("terminal"));
  }

  function showCounts(doc) {
    const machine = view.requestMachine;
    for (const [key, g] of view.phases) {
      const [name, phase] = key.split("/");
      if (name === machine) {
        if (g.classList.contains("terminal")) {
          const n = doc.ended[phase] || 0;
          setCount(name, phase, n, `${n} ended`);
        } else {
          const n = doc.live[phase] || 0;
          setCount(name, phase, n, `${n} now`);
        }
      } else if (name === "role_loop") {
        const current = doc.loop === phase;
        g.classList.toggle("current", current);
        setCount(name, phase, current ? 1 : 0, current ? "now" : "");
      } else if (name === "peer_health" && doc.peers) {
        const n = doc.peers.filter(p => p.phase === phase).length;
        setCount(name, phase, n, n ? `${n} peer${n > 1 ? "s" : ""}` : "");
        g.classList.toggle("busy", n > 0);
      }
    }
    const loop = document.getElementById("loop");
    loop.textContent = `loop: ${doc.loop}`;
  }

  function flash(node) {
    if (!node) return;
    node.classList.add(node.classList.contains("edge") ? "fired" : "flash");
    setTimeout(() => node.classList.remove("fired", "flash"), FLASH_MS);
  }

  function clock(seconds) {
    const d = new Date(seconds * 1000);
    return d.toTimeString().slice(0, 8) + "." + String(d.getMilliseconds()).padStart(3, "0");
  }

  function showTransitions(transitions) {
    const list = document.getElementById("transitions");
    for (const t of transitions) {
      const li = document.createElement("li");
      li.dataset.machine = t.machine;
      li.dataset.subject = t.subject;
      li.dataset.from = t.source;
      li.dataset.to = t.target;
      li.className = `to-${t.target}`;
      html("span", clock(t.at) + " ", li).className = "when";
      const cause = t.event ? ` on ${t.event}` + (t.reason ? ` (${t.reason})` : "") : "";
      const who = t.machine === "peer_health" ? `peer ${t.subject}` : t.subject;
      html("span", who, li).className = "subject";
      html("span", ` ${t.source} → ${t.target}${cause}`, li);
      li.title = li.textContent;
      list.prepend(li);
      flash(view.edges.get(`${t.machine}/${t.source}>${t.target}`));
      flash(view.phases.get(`${t.machine}/${t.target}`));
    }
    while (list.children.length > TRANSITIONS_SHOWN) list.lastElementChild.remove();
  }

  function showPeers(peers) {
    const section = document.getElementById("peers");
    if (!peers) return;
    section.hidden = false;
    const body = section.querySelector("tbody");
    body.replaceChildren();
    for (const peer of peers) {
      const row = html("tr", undefined, body);
      row.dataset.url = peer.url;
      html("td", peer.url, row);
      html("td", peer.role, row);
      html("td", peer.phase, row).className = `phase-${peer.phase}`;
      html("td", String(peer.in_flight), row);
    }
  }

  function formatValue(value, unit) {
    if (value === null || value === undefined) return "–";
    if (unit === "B/s") {
      const steps = ["B/s", "KB/s", "MB/s", "GB/s"];
      let i = 0;
      while (value >= 1000 && i < steps.length - 1) { value /= 1000; i++; }
      return `${value.toFixed(value < 10 && i > 0 ? 1 : 0)} ${steps[i]}`;
    }
    if (unit === "s") return value < 1 ? `${(value * 1000).toFixed(0)} ms` : `${value.toFixed(2)} s`;
    return `${value.toFixed(value < 10 ? 1 : 0)} ${unit}`;
  }

  function showSamples(samples) {
    view.samples.push(...samples);
    if (view.samples.length > SAMPLES_SHOWN) view.samples.splice(0, view.samples.length - SAMPLES_SHOWN);
    for (const box of document.querySelectorAll(".spark")) {
      const field = box.dataset.field, unit = box.dataset.unit;
      const values = view.samples.map(s => s[field]);
      const known = values.filter(v => v !== null && v !== undefined);
      const latest = known.length ? known[known.length - 1] : null;
      box.querySelector(".value").textContent = formatValue(latest, unit);
      box.dataset.latest = latest === null ? "" : String(latest);
      box.dataset.peak = known.length ? String(Math.max(...known)) : "";
      const chart = box.querySelector("svg");
      chart.setAttribute("viewBox", `0 0 ${SAMPLES_SHOWN} 36`);
      chart.setAttribute("preserveAspectRatio", "none");
      // one bar per second, newest on the right: a lone second of traffic still shows
      const top = Math.max(...known, 1e-9);
      const offset = SAMPLES_SHOWN - values.length;
      const bars = values.map((v, i) => v === null || v === undefined || v <= 0 ? ""
        : `M ${offset + i + 0.5} 36 V ${(35 - (v / top) * 33).toFixed(1)}`).join(" ");
      if (!chart.querySelector("line.grid")) {  // the axes: zero, and the top the bars scale to
        svg("line", {class: "grid", x1: 0, x2: SAMPLES_SHOWN, y1: 35.5, y2: 35.5}, chart);
        svg("line", {class: "grid", x1: 0, x2: SAMPLES_SHOWN, y1: 2, y2: 2}, chart);
      }
      box.querySelector(".ymax").textContent = known.length ? `top ${formatValue(top, unit)}` : "";
      const path = chart.querySelector("path") || svg("path", {}, chart);
      path.setAttribute("d", bars);
    }
  }

  function dropKvChart() {
    // KV moves between prefill and decode nodes only: elsewhere the chart would stay at 0
    document.getElementById("spark-kv").remove();
  }

  function apply(doc) {
    if (view.boot !== doc.boot) view.samples = [];  // another process: its rates start afresh
    view.boot = doc.boot;
    showCounts(doc);
    showTransitions(doc.transitions);
    showSamples(doc.samples);
    showPeers(doc.peers);
    if (doc.closing) {  // the node's loop has stopped; the stream ends after this message
      view.closing = true;
      setStatus("node stopping", "down");
    }
  }

  function setStatus(words, kind) {
    const status = document.getElementById("status");
    status.textContent = words;
    status.className = `badge ${kind}`;
  }

  async function start() {
    const graph = await (await fetch("/ui/graph.json")).json();
    view.role = graph.role;
    view.requestMachine = graph.request_machine;
    document.getElementById("role").textContent = graph.role;
    document.title = `statecore ${graph.role} · live`;
    const container = document.getElementById("machines");
    for (const machine of graph.machines) drawMachine(machine, container);
    if (graph.role !== "prefill" && graph.role !== "decode") dropKvChart();
    const events = new EventSource("/ui/events");
    events.onopen = () => { view.closing = false; setStatus("live", "live"); };
    // the browser retries by itself; a node that comes back is followed again
    events.onerror = () => setStatus(view.closing ? "node stopped" : "reconnecting", "down");
    events.onmessage = message => apply(JSON.parse(message.data));
  }

  start().catch(error => setStatus(`failed: ${error}`, "down"));
})();
