"""Soak: a 1 prefill + 2 decode cluster at saturation for N minutes, every outcome checked.

    .venv/bin/python bench/serving/soak.py --minutes 30 [--concurrency 16] [--model DIR] [--out FILE]

Starts its own cluster on 127.0.0.1 (fault injection armed) and keeps `--concurrency` clients
busy with a mix: good requests (completions and chat, streaming and not, prompts of a few to
~1,500 tokens, greedy and seeded, replayed from a pool so each answer can be compared with its
first one), streams the client leaves after a few events, malformed bodies of many kinds, and
requests marked for every fault phase that fails one request, typed and untyped (never
`device_crash` or `decode_call_hang`, which end a node on purpose). Every reply is checked
against what it must be: a good request succeeds with a well-formed body or an SSE stream ending
in [DONE], byte-equal to the first answer to the same greedy or seeded request; a malformed body
gets its 4xx in OpenAI's error shape; a marked request ends with its typed error (or succeeds,
for the transient `decode_call_once` and the slow phases); after an error reply that did not
say `Connection: close`, the next request on that connection (GET /v1/models) must work.

Half way through, one decode node is SIGKILLed and a new process started on its port; the
router must mark it down, send around it and take it back (down -> probing -> up). Requests
that were on that node when it died may fail with `transport_lost` ("lost with the node"); any
other failure is a violation. Every 30 s it prints outcomes, each node's RSS and live counts; at
the end totals, RSS per node over time and its growth after warm-up, that live counts are back
to zero (`assert_no_leaks`), each node's `bugs` counter and its exit code on SIGTERM. Exits 1 if
any check failed. Not part of CI.

A bench script: it sees the nodes only through HTTP, /proc and their exit codes, so it must never
import the serving code (`statecore`, `effects` beyond the fault phase names, the engine) to
look inside a node; and nothing in src/ or tests/ may import it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.harness import Node, assert_no_leaks, router, start_nodes

from effects.faults import ENABLE_ENV, Phase

LIVE_KEYS = ("live_requests", "live_tasks", "contexts", "decoding", "held_caches", "held_bytes",
             "kv_reserved_bytes")
ENDS_A_NODE = {Phase.DEVICE_CRASH, Phase.DECODE_CALL_HANG}
# What a request marked `inject-fault-<tag>` must end with: one of these error codes, or None
# (it must succeed like a good request).
FAULT_EXPECTED: dict[str, set[str] | None] = {
    Phase.INTAKE.value: {"injected_fault"},
    Phase.TOKENIZE.value: {"injected_fault"},
    Phase.PREFILL.value: {"injected_fault"},
    Phase.KV_ENCODE.value: {"injected_fault"},
    Phase.SEND_HEADER.value: {"kv_truncated"},
    Phase.MID_BODY.value: {"kv_truncated"},
    Phase.CHECKSUM.value: {"kv_checksum_mismatch"},
    Phase.INSTALL.value: {"injected_fault"},
    Phase.DECODE_STEP.value: {"injected_fault"},
    Phase.STREAM_OUT.value: {"transport_lost"},
    Phase.DECODE_CALL_ONCE.value: None,  # a transient engine error: retried, never seen
    Phase.DECODE_CALL_ALWAYS.value: {"engine_failed"},  # a poisoned row: only it fails
    "slow-" + Phase.PREFILL.value: None,  # stalls 1 s, then succeeds
    "slow-" + Phase.KV_ENCODE.value: None,
}
# The same phases raising a plain RuntimeError (a bug's shape): only that request fails.
UNTYPED = [Phase.INTAKE, Phase.TOKENIZE, Phase.PREFILL, Phase.KV_ENCODE, Phase.INSTALL, Phase.DECODE_STEP]
FAULT_EXPECTED.update({f"untyped-{p.value}": {"internal_error"} for p in UNTYPED})
assert {p.value for p in Phase} - {p.value for p in ENDS_A_NODE} <= set(FAULT_EXPECTED), "a phase is missing"
ARMED = [p.value for p in Phase if p not in ENDS_A_NODE] + ["prefill:slow=1", "kv_encode:slow=1"] + [
    f"{p.value}:untyped" for p in UNTYPED]

WORDS = ["the", "harbour", "lights", "came", "on", "one", "by", "while", "tide", "turned", "and",
         "gulls", "argued", "over", "nets", "drying", "quay", "a", "boat", "with", "red", "sail",
         "rounded", "point"]
KINDS = ("good", "cancel", "malformed", "fault", "reuse")
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _text_of(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _prompt_words(rng: random.Random) -> int:
    """Mostly short prompts, some medium, a few long (~3 tokens a word: up to ~1,500 tokens)."""
    r = rng.random()
    if r < 0.7:
        return rng.randint(2, 20)
    if r < 0.95:
        return rng.randint(30, 150)
    return rng.randint(300, 500)


_pool_rng = random.Random(12)
POOL = [_text_of(_prompt_words(_pool_rng), _pool_rng) for _ in range(24)]  # replayed prompts

# (name, path, body: JSON-able or raw bytes, expected status, expected error codes)
MALFORMED: list[tuple[str, str, Any, int, set[str]]] = [
    ("broken_json", COMPLETIONS, b'{"prompt": "hi", "max_tokens": 5', 400, {"invalid_json"}),
    ("not_json", COMPLETIONS, b"prompt=hi&max_tokens=5", 400, {"invalid_json"}),
    ("not_an_object", COMPLETIONS, [1, 2, 3], 400, {"invalid_request"}),
    ("prompt_wrong_type", COMPLETIONS, {"prompt": 42, "max_tokens": 5}, 400, {"invalid_request"}),
    ("prompt_missing", COMPLETIONS, {"max_tokens": 5}, 400, {"invalid_request"}),
    ("empty_prompt", COMPLETIONS, {"prompt": "", "max_tokens": 5}, 400, {"invalid_request"}),
    ("max_tokens_string", COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, {"invalid_request"}),
    ("max_tokens_zero", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, {"invalid_request"}),
    ("max_tokens_negative", COMPLETIONS, {"prompt": "hi", "max_tokens": -3}, 400, {"invalid_request"}),
    ("max_tokens_over_context", COMPLETIONS, {"prompt": "hi", "max_tokens": 10_000_000}, 400,
     {"context_length_exceeded"}),
    ("prompt_over_context", COMPLETIONS, {"prompt": "word " * 5000, "max_tokens": 5}, 400,
     {"context_length_exceeded"}),
    ("temperature_too_high", COMPLETIONS, {"prompt": "hi", "temperature": 5}, 400, {"invalid_request"}),
    ("stream_options_without_stream", COMPLETIONS,
     {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, {"invalid_request"}),
    ("n_above_limit", COMPLETIONS, {"prompt": "hi", "n": 17}, 400, {"invalid_request"}),
    ("logprobs_above_limit", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, {"invalid_request"}),
    ("adapters", COMPLETIONS, {"prompt": "hi", "adapters": "lora"}, 422, {"unsupported_parameter"}),
    ("unknown_model", COMPLETIONS, {"prompt": "hi", "model": "no-such-model"}, 404, {"model_not_found"}),
    ("body_too_large", COMPLETIONS, b'{"prompt": "' + b"a" * (4 * 1024 * 1024 + 16) + b'"}', 413,
     {"body_too_large"}),
    ("chat_empty_messages", CHAT, {"messages": []}, 400, {"invalid_request"}),
    ("chat_messages_string", CHAT, {"messages": "hello"}, 400, {"invalid_request"}),
    ("chat_no_content", CHAT, {"messages": [{"role": "user"}]}, 400, {"invalid_request"}),
    ("chat_temperature_string", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                       "temperature": "hot"}, 400, {"invalid_request"}),
]


@dataclass
class Reply:
    status: int  # 0: the client's own transport failed
    pieces: list[Any]  # the JSON body, or the SSE data payloads ("[DONE]" as a string)
    transport: str = ""  # the client-side exception, when status is 0
    left: bool = False  # the client left the stream on purpose
    closes: bool = False  # the response said `Connection: close`


def _call(client: httpx.Client, url: str, path: str, body: Any, request_id: str, *,
          stream: bool, leave_after: int = 0) -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"x-request-id": request_id, "content-type": "application/json"}
    try:
        if not stream:
            r = client.post(f"{url}{path}", content=raw, headers=headers)
            closes = r.headers.get("connection", "").lower() == "close"
            try:
                return Reply(r.status_code, [r.json()], closes=closes)
            except ValueError:
                return Reply(r.status_code, [r.text[:300]], closes=closes)
        pieces: list[Any] = []
        with client.stream("POST", f"{url}{path}", content=raw, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                closes = r.headers.get("connection", "").lower() == "close"
                try:
                    return Reply(r.status_code, [r.json()], closes=closes)
                except ValueError:
                    return Reply(r.status_code, [r.text[:300]], closes=closes)
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                try:
                    pieces.append(data if data == "[DONE]" else json.loads(data))
                except ValueError:
                    pieces.append({"unparseable": data[:200]})
                if leave_after and len(pieces) >= leave_after and pieces[-1] != "[DONE]":
                    return Reply(200, pieces, left=True)  # leaving the block closes the connection
        return Reply(200, pieces)
    except httpx.HTTPError as exc:
        return Reply(0, [], transport=f"{type(exc).__name__}: {exc}"[:300])


def _error_shape(doc: Any) -> str | None:
    """None when `doc` is OpenAI's error body; else what is wrong with it."""
    if not isinstance(doc, dict) or not isinstance(doc.get("error"), dict):
        return f"not an error body: {str(doc)[:200]}"
    error = doc["error"]
    for key in ("message", "type", "code"):
        if not isinstance(error.get(key), str) or not error[key]:
            return f"error.{key} missing or empty: {error}"
    if "param" not in error:
        return f"error.param missing: {error}"
    return None


def _failure_code(reply: Reply) -> str:
    """The error code a failed reply carried ('' when none could be read)."""
    if reply.status == 0:
        return "client_transport"
    docs = reply.pieces if reply.status == 200 else reply.pieces[:1]
    for doc in docs:
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return str(doc["error"].get("code", ""))
    return ""


def _check_success(reply: Reply, path: str, max_tokens: int, usage_chunk: bool) -> tuple[str | None, str]:
    """(problem or None, the generated text) for a reply that must have succeeded."""
    if reply.status != 200:
        return f"HTTP {reply.status or reply.transport}: {str(reply.pieces)[:300]}", ""
    chat = path == CHAT
    if len(reply.pieces) == 1 and isinstance(reply.pieces[0], dict) and "choices" in reply.pieces[0]:
        doc = reply.pieces[0]
        try:
            choice = doc["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            finish = choice["finish_reason"]
            used = doc["usage"]["completion_tokens"]
        except (KeyError, IndexError, TypeError):
            return f"malformed body: {str(doc)[:300]}", ""
        if not isinstance(text, str) or finish not in ("stop", "length"):
            return f"malformed choice: {str(choice)[:300]}", ""
        if not 1 <= used <= max_tokens or (finish == "length" and used != max_tokens):
            return f"completion_tokens {used} with max_tokens {max_tokens}, finish {finish}", text
        return None, text
    pieces = reply.pieces
    if not pieces or pieces[-1] != "[DONE]":
        return f"stream did not end with [DONE]: {str(pieces[-3:])[:300]}", ""
    events = pieces[:-1]
    errors = [e for e in events if not isinstance(e, dict) or "error" in e or "unparseable" in e]
    if errors:
        return f"error or bad event in stream: {str(errors[0])[:300]}", ""
    parts: list[str] = []
    finishes: list[str] = []
    usage: Any = None
    for event in events:
        if not event.get("choices"):
            usage = event.get("usage")
            continue
        choice = event["choices"][0]
        piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
        parts.append(piece or "")
        if choice.get("finish_reason") is not None:
            finishes.append(choice["finish_reason"])
    if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
        return f"stream finish reasons {finishes}", ""
    used = usage.get("completion_tokens", 0) if isinstance(usage, dict) else 0
    if usage_chunk and not 1 <= used <= max_tokens:
        return f"stream usage chunk missing or wrong: {usage}", ""
    return None, "".join(parts)


@dataclass
class Record:
    kind: str  # good | cancel | malformed | fault
    label: str
    request_id: str
    start: float
    end: float
    verdict: str  # ok | lost_with_node | violation
    stream: bool = False
    code: str = ""
    detail: str = ""


@dataclass
class Soak:
    args: argparse.Namespace
    router: Node
    prefill: list[Node]
    decode: list[Node]
    t0: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter[str] = field(default_factory=Counter)  # "kind:verdict"
    by_label: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    violations: list[Record] = field(default_factory=list)
    lost: list[Record] = field(default_factory=list)
    references: dict[str, str] = field(default_factory=dict)  # replayed request -> its first text
    kill_t: float | None = None  # monotonic seconds
    events: list[tuple[float, str]] = field(default_factory=list)  # (elapsed s, what happened)
    samples: list[dict[str, Any]] = field(default_factory=list)
    stop_at: float = 0.0

    @property
    def nodes(self) -> dict[str, Node]:
        named = {"router": self.router}
        named.update({f"prefill{i}": n for i, n in enumerate(self.prefill)})
        named.update({f"decode{i}": n for i, n in enumerate(self.decode)})
        return named

    def elapsed(self, t: float | None = None) -> float:
        return (time.monotonic() if t is None else t) - self.t0

    def note(self, what: str) -> None:
        with self.lock:
            self.events.append((round(self.elapsed(), 2), what))
        print(f"[{self.elapsed() / 60:5.2f} min] {what}", flush=True)

    # -- outcomes ----------------------------------------------------------------------------

    def record(self, kind: str, label: str, request_id: str, start: float, problem: str | None,
               reply: Reply, stream: bool) -> Record:
        end = time.monotonic()
        verdict, code = "ok", ""
        if problem is not None:
            code = _failure_code(reply)
            window = self.args.loss_window_s
            on_the_node = self.kill_t is not None and start <= self.kill_t <= end <= self.kill_t + window
            verdict = "lost_with_node" if code == "transport_lost" and on_the_node else "violation"
        rec = Record(kind, label, request_id, round(self.elapsed(start), 3), round(self.elapsed(end), 3),
                     verdict, stream, code, problem or "")
        with self.lock:
            self.counts[f"{kind}:{verdict}"] += 1
            self.by_label[kind][f"{label}:{verdict}"] += 1
            if verdict == "violation":
                self.violations.append(rec)
            elif verdict == "lost_with_node":
                self.lost.append(rec)
        if verdict == "violation" and len(self.violations) <= 20:
            print(f"  VIOLATION {kind}/{label} {request_id}: {problem}", flush=True)
        return rec

    def compare(self, key: str | None, text: str) -> str | None:
        if key is None:
            return None
        with self.lock:
            first = self.references.setdefault(key, text)
        if first == text:
            return None
        return f"output differs from the first answer: {text[:80]!r} vs {first[:80]!r}"

    # -- one request of each kind ----------------------------------------------------------------

    def one(self, client: httpx.Client, rng: random.Random, rid: str) -> None:
        a = self.args
        r = rng.random()
        if r < a.cancel_rate:
            rec, reply = self.cancel(client, rng, rid)
        elif r < a.cancel_rate + a.malformed_rate:
            rec, reply = self.malformed(client, rng, rid)
        elif r < a.cancel_rate + a.malformed_rate + a.fault_rate:
            rec, reply = self.fault(client, rng, rid)
        else:
            rec, reply = self.good(client, rng, rid)
        if reply.status >= 400 and not reply.closes:
            self.reuse(client, rec, reply)

    def reuse(self, client: httpx.Client, after: Record, reply: Reply) -> None:
        """An error reply that kept the connection open: the next request on it must work. (A
        server that answers before reading the body and then closes the connection must say
        `Connection: close`, or the client's next request on it fails.)"""
        start = time.monotonic()
        problem: str | None = None
        try:
            probe = client.get(f"{self.router.url}/v1/models")
            if probe.status_code != 200:
                problem = f"GET /v1/models after it: HTTP {probe.status_code}"
        except httpx.HTTPError as exc:
            problem = (f"the connection was dropped after HTTP {reply.status} without `Connection: close`: "
                       f"the next request on it failed with {type(exc).__name__}: {exc}")
        self.record("reuse", f"after {after.kind}/{after.label}", after.request_id, start, problem,
                    Reply(0, []), False)

    def _good_body(self, rng: random.Random) -> tuple[str, dict[str, Any], str, str | None]:
        """(path, body, label, reference key or None)."""
        path = CHAT if rng.random() < 0.3 else COMPLETIONS
        r = rng.random()
        body: dict[str, Any]
        if r < 0.5:  # greedy, replayed
            index, max_tokens = rng.randrange(len(POOL)), rng.choice([8, 32, 100])
            body, label = {"max_tokens": max_tokens, "temperature": 0}, "greedy"
            key: str | None = f"{path}|{index}|{max_tokens}|greedy"
            prompt = POOL[index]
        elif r < 0.8:  # seeded, replayed
            index, max_tokens, seed = rng.randrange(len(POOL)), rng.choice([16, 64]), rng.randrange(8)
            body = {"max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": seed}
            label, key, prompt = "seeded", f"{path}|{index}|{max_tokens}|seed{seed}", POOL[index]
        else:  # sampled without a seed, a fresh prompt
            body = {"max_tokens": rng.randint(1, 128), "temperature": 1.0}
            label, key, prompt = "sampled", None, _text_of(_prompt_words(rng), rng)
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return path, body, label, key

    def good(self, client: httpx.Client, rng: random.Random, rid: str) -> tuple[Record, Reply]:
        path, body, label, key = self._good_body(rng)
        stream = rng.random() < 0.5
        usage = stream and rng.random() < 0.5
        if stream:
            body["stream"] = True
            if usage:
                body["stream_options"] = {"include_usage": True}
        start = time.monotonic()
        reply = _call(client, self.router.url, path, body, f"{rid}-good", stream=stream)
        problem, text = _check_success(reply, path, body["max_tokens"], usage)
        if problem is None:
            problem = self.compare(key, text)
        label = f"{label}{'-sse' if stream else ''}"
        return self.record("good", label, f"{rid}-good", start, problem, reply, stream), reply

    def cancel(self, client: httpx.Client, rng: random.Random, rid: str) -> tuple[Record, Reply]:
        path = CHAT if rng.random() < 0.3 else COMPLETIONS
        body: dict[str, Any] = {"max_tokens": rng.randint(200, 500), "temperature": 0.7, "stream": True}
        prompt = _text_of(_prompt_words(rng), rng)
        if path == CHAT:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        start = time.monotonic()
        reply = _call(client, self.router.url, path, body, f"{rid}-cancel", stream=True,
                      leave_after=rng.randint(2, 8))
        problem: str | None = None
        if reply.status != 200:
            problem = f"HTTP {reply.status or reply.transport}: {str(reply.pieces)[:300]}"
        else:
            bad = [p for p in reply.pieces if p != "[DONE]" and (not isinstance(p, dict) or "error" in p
                                                                or "unparseable" in p)]
            if bad:
                problem = f"error or bad event before leaving: {str(bad[0])[:300]}"
        label = "left" if reply.left else "finished_first"
        return self.record("cancel", label, f"{rid}-cancel", start, problem, reply, True), reply

    def malformed(self, client: httpx.Client, rng: random.Random, rid: str) -> tuple[Record, Reply]:
        name, path, body, status, codes = rng.choice(MALFORMED)
        start = time.monotonic()
        reply = _call(client, self.router.url, path, body, f"{rid}-bad", stream=False)
        problem: str | None = None
        if reply.status != status:
            got = reply.status or reply.transport
            problem = f"expected HTTP {status}, got {got}: {str(reply.pieces)[:300]}"
        else:
            problem = _error_shape(reply.pieces[0])
            if problem is None and reply.pieces[0]["error"]["code"] not in codes:
                problem = f"expected code {codes}, got {reply.pieces[0]['error']}"
        return self.record("malformed", name, f"{rid}-bad", start, problem, reply, False), reply

    def fault(self, client: httpx.Client, rng: random.Random, rid: str) -> tuple[Record, Reply]:
        tag = rng.choice(list(FAULT_EXPECTED))
        expected = FAULT_EXPECTED[tag]
        stream = rng.random() < 0.5
        max_tokens = rng.randint(8, 32)
        body: dict[str, Any] = {"prompt": rng.choice(POOL), "max_tokens": max_tokens,
                                "temperature": rng.choice([0, 0.8]), "seed": rng.randrange(8)}
        if stream:
            body["stream"] = True
        request_id = f"{rid}-inject-fault-{tag}"
        start = time.monotonic()
        reply = _call(client, self.router.url, COMPLETIONS, body, request_id, stream=stream)
        problem: str | None
        if expected is None:
            problem, _ = _check_success(reply, COMPLETIONS, max_tokens, False)
        elif reply.status == 0:
            problem = f"client transport: {reply.transport}"
        elif reply.status != 200:
            problem = _error_shape(reply.pieces[0])
            if problem is None and not 400 <= reply.status < 600:
                problem = f"HTTP {reply.status}"
            if problem is None and reply.pieces[0]["error"]["code"] not in expected:
                problem = f"expected code {expected}, got HTTP {reply.status} {reply.pieces[0]['error']}"
        elif not stream:
            problem = f"expected {expected}, got 200: {str(reply.pieces)[:200]}"
        elif len(reply.pieces) < 2 or reply.pieces[-1] != "[DONE]":
            problem = f"stream did not end with an error event then [DONE]: {str(reply.pieces[-3:])[:300]}"
        else:
            problem = _error_shape(reply.pieces[-2])
            if problem is None and reply.pieces[-2]["error"]["code"] not in expected:
                problem = f"expected code {expected}, got event {reply.pieces[-2]['error']}"
            if problem is None and any(isinstance(p, dict) and "error" in p for p in reply.pieces[:-2]):
                problem = "more than one error event"
        return self.record("fault", tag, request_id, start, problem, reply, stream), reply

    # -- watching the nodes ----------------------------------------------------------------------

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"t": round(self.elapsed(), 1), "nodes": {}}
        for name, node in self.nodes.items():
            entry: dict[str, Any] = {"pid": None, "rss_mib": None}
            process = node.process
            if process is not None and process.poll() is None:
                entry["pid"] = process.pid
                entry["rss_mib"] = _rss_mib(process.pid)
                try:
                    stats = node.stats()
                    entry.update({k: stats.get(k) for k in (*LIVE_KEYS, "bugs")})
                except (httpx.HTTPError, ValueError) as exc:
                    entry["stats_error"] = type(exc).__name__
            row["nodes"][name] = entry
        with self.lock:
            counts = dict(self.counts)
        row["counts"] = counts
        self.samples.append(row)
        return row

    def print_sample(self, row: dict[str, Any]) -> None:
        print(f"-- {row['t'] / 60:5.2f} min  {_counts_line(row['counts'])}", flush=True)
        for name, entry in row["nodes"].items():
            if entry["pid"] is None or entry["rss_mib"] is None:  # not started, or just killed
                print(f"   {name:9s} (not running)")
                continue
            live = "/".join("-" if entry.get(k) is None else str(entry[k]) for k in LIVE_KEYS)
            print(f"   {name:9s} pid {entry['pid']:>7}  rss {entry['rss_mib']:7.1f} MiB  "
                  f"live req/tasks/ctx/dec/caches/bytes/reserved {live}  bugs {entry.get('bugs', '?')}",
                  flush=True)

    def watch_peers(self, done: threading.Event) -> None:
        """Note every change of the router's view of its peers (its health machines)."""
        last: dict[str, str] = {}
        names = {n.url: name for name, n in self.nodes.items()}
        while not done.is_set():
            try:
                peers: dict[str, str] = self.router.stats()["peers"]
            except (httpx.HTTPError, ValueError, KeyError):
                peers = {}
            for url, phase in peers.items():
                if last.get(url) != phase:
                    if url in last:
                        self.note(f"router: {names.get(url, url)} {last[url]} -> {phase}")
                    last[url] = phase
            done.wait(0.1)

    def peer_phase(self, node: Node) -> str:
        try:
            phase: str = self.router.stats()["peers"][node.url]
            return phase
        except (httpx.HTTPError, ValueError, KeyError):
            return "?"

    def kill_and_restart(self, result: dict[str, Any]) -> None:
        """SIGKILL the busier decode node, wait until the router marks it down, start a new process
        on the same port, wait until the router takes it back."""
        def live(node: Node) -> dict[str, int]:
            try:
                stats = node.stats()
                return {"live_requests": int(stats["live_requests"]), "decoding": int(stats["decoding"])}
            except (httpx.HTTPError, ValueError, KeyError):
                return {"live_requests": -1, "decoding": -1}
        victim = max(reversed(self.decode), key=lambda n: live(n)["live_requests"])
        name = next(k for k, n in self.nodes.items() if n is victim)
        assert victim.process is not None
        old = victim.process
        result.update(node=name, url=victim.url, old_pid=old.pid, at_kill=live(victim))
        with self.lock:
            self.kill_t = time.monotonic()
        old.send_signal(signal.SIGKILL)
        old.wait()
        result["killed_at_s"] = round(self.elapsed(self.kill_t), 2)
        self.note(f"SIGKILL {name} (pid {old.pid}, {result['at_kill']['live_requests']} live requests, "
                  f"{result['at_kill']['decoding']} decoding); exit {old.returncode}")
        deadline = time.monotonic() + 30
        while self.peer_phase(victim) != "down" and time.monotonic() < deadline:
            time.sleep(0.05)
        result["router_down_s"] = round(self.elapsed(), 2) if self.peer_phase(victim) == "down" else None
        time.sleep(self.args.restart_after_s)
        victim.process = None
        victim.start()  # binds the same port again
        victim.wait_healthy()
        assert victim.process is not None
        result.update(new_pid=victim.process.pid, restarted_healthy_s=round(self.elapsed(), 2))
        self.note(f"{name} restarted (pid {victim.process.pid}) on {victim.url}, /health 200")
        deadline = time.monotonic() + 60
        while self.peer_phase(victim) != "up" and time.monotonic() < deadline:
            time.sleep(0.05)
        result["router_up_s"] = round(self.elapsed(), 2) if self.peer_phase(victim) == "up" else None
        self.note(f"router sees {name} as {self.peer_phase(victim)}")


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _log_warnings(logs: Path) -> Counter[str]:
    """Every node log line at WARNING or above, grouped by node and message (request ids and
    numbers blanked out)."""
    seen: Counter[str] = Counter()
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(None, 4)
            if len(parts) == 5 and parts[3] in ("WARNING", "ERROR", "CRITICAL"):
                message = re.sub(r"soak-[\w.-]+|\d+(\.\d+)?", "N", parts[4])[:150]
                seen[f"{log.stem} {parts[3]} {message}"] += 1
    return seen


def _counts_line(counts: dict[str, int]) -> str:
    parts = []
    for kind in KINDS:
        ok, lost, bad = (counts.get(f"{kind}:{v}", 0) for v in ("ok", "lost_with_node", "violation"))
        parts.append(f"{kind} {ok}" + (f" (+{lost} lost)" if lost else "")
                     + (f" ({bad} VIOLATIONS)" if bad else ""))
    return " | ".join(parts)


def _rss_report(soak: Soak, warmup_s: float) -> dict[str, Any]:
    """Per node and per process (a restarted node has two): RSS at its start, after warm-up, at
    the end, and the growth after warm-up."""
    out: dict[str, Any] = {}
    for name in soak.nodes:
        by_pid: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for row in soak.samples:
            entry = row["nodes"][name]
            if entry["pid"] is not None and entry["rss_mib"] is not None:
                by_pid[entry["pid"]].append((row["t"], entry["rss_mib"]))
        for pid, points in by_pid.items():
            born = points[0][0]
            settled = [p for p in points if p[0] >= born + warmup_s] or points[-1:]
            after = settled[0]
            out[f"{name}/{pid}"] = {
                "node": name, "pid": pid, "first_t": born, "start_mib": points[0][1],
                "warm_t": after[0], "warm_mib": after[1], "end_t": points[-1][0], "end_mib": points[-1][1],
                "max_after_warmup_mib": max(p[1] for p in settled),
                "growth_after_warmup_mib": round(points[-1][1] - after[1], 1),
            }
    return out


def _print_rss_table(soak: Soak) -> None:
    names = list(soak.nodes)
    rows = soak.samples
    step = max(1, math.ceil(len(rows) / 32))
    shown = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    print("\nRSS per node over time (MiB; * = a new process since the row above):")
    print("  min    " + "".join(f"{n:>11s}" for n in names))
    last_pid: dict[str, int | None] = {}
    for row in shown:
        cells = []
        for n in names:
            entry = row["nodes"][n]
            mark = "*" if n in last_pid and entry["pid"] not in (None, last_pid[n]) else " "
            last_pid[n] = entry["pid"] if entry["pid"] is not None else last_pid.get(n)
            rss = entry["rss_mib"]
            cells.append(f"{rss:>10.1f}{mark}" if rss is not None else f"{'-':>11s}")
        print(f"  {row['t'] / 60:5.1f}  " + "".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--model", type=Path, default=None, help="default: the tiny llama checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-at-minute", type=float, default=None,
                        help="SIGKILL a decode node then (default: half way; negative: never)")
    parser.add_argument("--restart-after-s", type=float, default=5.0,
                        help="seconds between the router marking the node down and its restart")
    parser.add_argument("--loss-window-s", type=float, default=30.0,
                        help="requests in flight at the kill may fail with transport_lost until then")
    parser.add_argument("--cancel-rate", type=float, default=0.05, help="streams left after a few events")
    parser.add_argument("--malformed-rate", type=float, default=0.05)
    parser.add_argument("--fault-rate", type=float, default=0.05, help="requests marked for a fault phase")
    parser.add_argument("--lease-wait-s", type=float, default=75.0,
                        help="when live counts are not zero 30 s after the end, wait this much more "
                        "(a KV whose release was lost is freed by its 60 s lease)")
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=None, help="write a JSON summary here")
    args = parser.parse_args()
    os.environ[ENABLE_ENV] = "1"
    if args.model is None:
        from support.tiny_models import cached_checkpoint  # loads mlx: only when needed

        args.model = cached_checkpoint("llama")
    kill_at = args.minutes / 2 if args.kill_at_minute is None else args.kill_at_minute
    faults = [arg for phase in ARMED for arg in ("--inject-fault", phase)]
    logs = Path(tempfile.mkdtemp(prefix="statecore-soak-"))
    print(f"soak: {args.minutes} min, concurrency {args.concurrency}, model {args.model}, seed {args.seed}, "
          f"cancel {args.cancel_rate:.0%} malformed {args.malformed_rate:.0%} fault {args.fault_rate:.0%}, "
          f"kill a decode node at {kill_at} min, logs {logs}", flush=True)
    common = ["--model", str(args.model), *faults]
    prefill = [Node("prefill", common, logs / "prefill0.log")]
    decode = [Node("decode", common, logs / f"decode{i}.log") for i in range(2)]
    start_nodes([*prefill, *decode])
    front = router(args.model, logs / "router.log", prefill, decode, "--force-disaggregation", *faults)
    start_nodes([front])
    soak = Soak(args, front, prefill, decode)
    failures: list[str] = []
    kill: dict[str, Any] = {}
    exit_codes: dict[str, int] = {}
    final_stats: dict[str, Any] = {}
    leaks = late = ""
    done = threading.Event()
    try:
        soak.print_sample(soak.sample())
        soak.t0 = time.monotonic()
        soak.stop_at = soak.t0 + args.minutes * 60

        def worker(index: int) -> None:
            rng = random.Random(args.seed * 1000 + index)
            with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
                n = 0
                while time.monotonic() < soak.stop_at:
                    soak.one(client, rng, f"soak-{index}-{n}")
                    n += 1

        watcher = threading.Thread(target=soak.watch_peers, args=(done,), daemon=True)
        watcher.start()
        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(args.concurrency)]
        for thread in threads:
            thread.start()
        killer: threading.Thread | None = None
        next_sample = soak.t0 + args.sample_s
        while any(t.is_alive() for t in threads):
            now = time.monotonic()
            if killer is None and kill_at >= 0 and now >= soak.t0 + kill_at * 60:
                killer = threading.Thread(target=soak.kill_and_restart, args=(kill,), daemon=True)
                killer.start()
            if now >= next_sample:
                soak.print_sample(soak.sample())
                next_sample += args.sample_s
            time.sleep(0.2)
        if killer is not None:
            killer.join(timeout=120)
        soak.note("clients stopped")
        last = soak.sample()
        soak.print_sample(last)
        try:
            assert_no_leaks([front, *prefill, *decode], timeout_s=30)
        except AssertionError as exc:  # an orphan the KV lease (60 s) should still reclaim
            late = str(exc)
            soak.note(f"live counts not zero 30 s after the clients stopped: {late}")
            try:
                assert_no_leaks([front, *prefill, *decode], timeout_s=args.lease_wait_s)
                soak.note("live counts zero after the lease wait")
            except AssertionError as exc2:
                leaks = str(exc2)
        for name, node in soak.nodes.items():
            try:
                stats = node.stats()
                health = httpx.get(f"{node.url}/health", timeout=5).status_code
            except (httpx.HTTPError, ValueError) as exc:
                failures.append(f"{name}: stats unreadable at the end ({exc})")
                continue
            final_stats[name] = {"health": health, **{k: stats.get(k) for k in (
                *LIVE_KEYS, "bugs", "outcomes", "engine_step_retries", "engine_rows_isolated", "peers")}}
    finally:
        done.set()
        for name, node in [("router", front), *((k, n) for k, n in soak.nodes.items() if k != "router")]:
            exit_codes[name] = node.stop()

    # -- the report ------------------------------------------------------------------------------
    counts = dict(soak.counts)
    total = sum(n for key, n in counts.items() if not key.startswith("reuse:"))
    print(f"\n== totals after {args.minutes} min: {total} requests ({total / (args.minutes * 60):.1f}/s), "
          "and a reuse check (GET /v1/models on the same connection) after each error reply")
    print(f"  {'kind':10s} {'ok':>8s} {'lost':>6s} {'violations':>10s}")
    for kind in KINDS:
        ok, lost, bad = (counts.get(f"{kind}:{v}", 0) for v in ("ok", "lost_with_node", "violation"))
        print(f"  {kind:10s} {ok:8d} {lost:6d} {bad:10d}")
    for kind in KINDS:
        labels = soak.by_label.get(kind, Counter())
        if kind == "reuse":  # only where a connection was dropped
            labels = Counter({k: v for k, v in labels.items() if not k.endswith(":ok")})
        print(f"  {kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(labels.items())))
    print(f"  greedy/seeded answers compared with their first: {len(soak.references)} distinct requests")
    if soak.lost:
        print(f"\nlost with the node ({len(soak.lost)}; in flight at the kill, transport_lost, "
              f"ended within {args.loss_window_s:.0f} s):")
        where = Counter(f"{r.kind}/{'sse' if r.stream else 'json'} while "
                        + (m.group(1) if (m := re.search(r"while it was (\w+)", r.detail)) else "?")
                        for r in soak.lost)
        print("  by kind and the router's phase: " + ", ".join(f"{k} {v}" for k, v in sorted(where.items())))
        for rec in soak.lost[:10]:
            print(f"  {rec.kind}/{rec.label} {rec.request_id} {rec.start:.1f}-{rec.end:.1f} s: "
                  f"{rec.detail[:160]}")
    if soak.violations:
        print(f"\nVIOLATIONS ({len(soak.violations)}):")
        for rec in soak.violations[:40]:
            print(f"  {rec.kind}/{rec.label} {rec.request_id} {rec.start:.1f}-{rec.end:.1f} s "
                  f"code {rec.code!r}: {rec.detail[:240]}")
        failures.append(f"{len(soak.violations)} violations")
    flaps = Counter(what.split()[1] for _, what in soak.events if what.endswith("suspect -> up"))
    flapped = ", ".join(f"{k} {v}" for k, v in sorted(flaps.items())) or "none"
    print("\nkill / restart timeline (health probes that were late under load, up -> suspect -> up with "
          f"the node keeping its work, counted apart: {flapped}):")
    for t, what in soak.events:
        if not what.endswith(("up -> suspect", "suspect -> up")):
            print(f"  {t:8.2f} s  {what}")
    if kill_at >= 0:
        if not kill.get("router_down_s"):
            failures.append("the router never marked the killed decode node down")
        if not kill.get("router_up_s"):
            failures.append("the router never took the restarted decode node back")
    _print_rss_table(soak)
    rss = _rss_report(soak, args.warmup_minutes * 60)
    print(f"\nRSS per process: start, after {args.warmup_minutes:g} min warm-up, end (MiB):")
    for key, r in rss.items():
        print(f"  {key:18s} {r['start_mib']:7.1f} @{r['first_t'] / 60:4.1f}m  {r['warm_mib']:7.1f} "
              f"@{r['warm_t'] / 60:4.1f}m  {r['end_mib']:7.1f} @{r['end_t'] / 60:4.1f}m  "
              f"growth after warm-up {r['growth_after_warmup_mib']:+.1f} "
              f"(max {r['max_after_warmup_mib']:.1f})")
    print("\nlive counts back to zero on every node: " + (
        f"NO: {leaks}" if leaks else "yes" if not late
        else f"yes, but only after the lease wait; 30 s after the end: {late}"))
    if leaks:
        failures.append(f"leaks: {leaks}")
    warnings = _log_warnings(logs)
    print(f"node log lines at WARNING or above, by kind ({sum(warnings.values())}):")
    for line, n in warnings.most_common():
        print(f"  {n:6d}  {line}")
    print("per node at the end (bugs must be 0, exit code on SIGTERM must be 0):")
    for name, code in exit_codes.items():
        stats = final_stats.get(name, {})
        print(f"  {name:9s} bugs {stats.get('bugs', '?')}  exit {code}  health {stats.get('health', '?')}  "
              f"retries {stats.get('engine_step_retries', '-')}  "
              f"isolated {stats.get('engine_rows_isolated', '-')}"
              f"  outcomes {stats.get('outcomes', {})}")
        if stats.get("bugs") != 0:
            failures.append(f"{name}: bugs {stats.get('bugs')}")
        if code != 0:
            failures.append(f"{name}: exit code {code}")
        if stats.get("health") != 200:
            failures.append(f"{name}: /health {stats.get('health')} at the end")
    print(f"\nlogs: {logs}")
    print("RESULT: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures)), flush=True)
    if args.out is not None:
        summary = {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "logs": str(logs), "total": total, "counts": counts,
            "by_label": {k: dict(v) for k, v in soak.by_label.items()},
            "violations": [asdict(r) for r in soak.violations[:500]],
            "lost_with_node": [asdict(r) for r in soak.lost],
            "kill": kill, "events": soak.events,
            "probe_flaps": dict(flaps), "rss": rss, "samples": soak.samples, "final": final_stats,
            "exit_codes": exit_codes, "leaks": leaks, "late_leaks": late, "log_warnings": dict(warnings),
            "failures": failures,
        }
        args.out.write_text(json.dumps(summary, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
