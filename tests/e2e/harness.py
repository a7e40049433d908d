"""Real `statecore run` processes on 127.0.0.1 for end-to-end tests.

`Node` is one child process with its log file, serving on a socket the harness bound and handed
down (`--listen-fd`), so no other process can take its port while it loads; `start_nodes`
starts several in parallel and waits until each answers /health; `stop` sends SIGTERM (a
drain) and returns the exit code. Every node's /internal/stats is checked for leaks by `assert_no_leaks`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from adapters.serve.cluster import wait_healthy
from adapters.serve.listeners import open_listener

if TYPE_CHECKING:  # the benchmarks borrow this harness where the official client is not installed
    from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    role: str
    args: list[str]
    log: Path
    listener: socket.socket | None = field(default_factory=lambda: open_listener("127.0.0.1", 0), repr=False)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if self.listener is not None:
            self.port = self.listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process; a restart binds the node's port again (it was freed by the exit)."""
        sock = self.listener if self.listener is not None else open_listener("127.0.0.1", self.port)
        self.listener = None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with sock, self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "adapters.cli", "run", "--role", self.role,
                 "--listen-fd", str(sock.fileno()), *self.args],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, pass_fds=(sock.fileno(),),
            )

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        assert self.process is not None
        problem = wait_healthy(self.url, self.process, timeout_s)
        if problem is not None:
            raise AssertionError(f"{self.role}: {problem}:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stats(self) -> dict[str, Any]:
        token = self.args[self.args.index("--internal-token") + 1] if "--internal-token" in self.args else ""
        headers = {"x-statecore-token": token} if token else {}
        data: dict[str, Any] = httpx.get(f"{self.url}/internal/stats", timeout=5.0, headers=headers).json()
        return data

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.listener is not None:  # never started
            self.listener.close()
            self.listener = None
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_nodes(nodes: list[Node], timeout_s: float = 30.0) -> None:
    """Start `nodes` and wait until each is healthy and every router among them sees each of its
    peers started here up (a router's first probe may come while a peer still loads: a request
    right after would find no healthy node until the next probe)."""
    try:
        for node in nodes:
            node.start()
        for node in nodes:
            node.wait_healthy()
        _wait_routers_see_peers(nodes, timeout_s)
    except BaseException:
        for node in nodes:  # none of them is left running when one fails to start
            node.stop()
        raise


def _wait_routers_see_peers(nodes: list[Node], timeout_s: float) -> None:
    started = {node.url for node in nodes}
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        if node.role != "router":
            continue
        while True:
            peers: dict[str, str] = node.stats()["peers"]
            if all(phase == "up" for url, phase in peers.items() if url in started):
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"router: its peers are {peers} {timeout_s:.0f} s after they started")
            time.sleep(0.05)


def router(model: Path, log: Path, prefill: list[Node], decode: list[Node], *extra: str) -> Node:
    # the tests read what happened to a request from the router's transitions (DEBUG otherwise)
    args = ["--model", str(model), "--log-transitions"]
    for node in prefill:
        args += ["--prefill", node.url]
    for node in decode:
        args += ["--decode", node.url]
    return Node("router", [*args, *extra], log)


@dataclass
class Cluster:
    """A single node and a router + prefill + decode cluster on the same model."""

    single: Node
    router: Node
    prefill: list[Node]
    decode: list[Node]

    @property
    def nodes(self) -> list[Node]:
        return [self.single, self.router, *self.prefill, *self.decode]

    def stop(self) -> None:
        """Stop every node; then fail if a node that was still running had caught bugs (its
        runner's `bugs` counter) or did not exit 0. Nodes a test killed on purpose are skipped."""
        problems: list[str] = []
        for node in self.nodes:
            running = node.process is not None and node.process.poll() is None
            if running:
                try:
                    bugs = node.stats()["bugs"]
                except httpx.HTTPError as exc:
                    bugs = f"unreadable ({exc!r})"
                if bugs != 0:
                    problems.append(f"{node.role} {node.url}: bugs {bugs}")
            code = node.stop()
            if running and code != 0:
                problems.append(f"{node.role} {node.url}: exit code {code} (log {node.log})")
        assert not problems, "; ".join(problems)


def openai_client(node: Node) -> OpenAI:
    """The official client on a node's public API (no key, no retries)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def start_cluster(model: Path, logs: Path, *, prefills: int = 1, decodes: int = 1,
                  router_args: tuple[str, ...] = ("--force-disaggregation",),
                  node_args: tuple[str, ...] = (), decode_args: tuple[str, ...] = (),
                  public_args: tuple[str, ...] = ()) -> Cluster:
    """`node_args` go to every engine node, `decode_args` to the decode nodes only, `public_args`
    to the single node and the router (the roles that serve the public API)."""
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--model", str(model), *node_args]
    single = Node("single", [*common, *public_args], logs / "single.log")
    prefill = [Node("prefill", common, logs / f"prefill{i}.log") for i in range(prefills)]
    decode = [Node("decode", [*common, *decode_args], logs / f"decode{i}.log") for i in range(decodes)]
    start_nodes([single, *prefill, *decode])
    front = router(model, logs / "router.log", prefill, decode, *router_args, *public_args)
    try:
        start_nodes([front])
    except BaseException:
        for node in [single, *prefill, *decode]:  # started above: not left running
            node.stop()
        raise
    return Cluster(single, front, prefill, decode)


LIVE_KEYS = ("live_requests", "live_tasks", "contexts")
ENGINE_KEYS = ("decoding", "held_caches", "held_bytes", "kv_reserved_bytes", "kv_arriving",
               "kv_shm_held_bytes", "kv_waiting")


def assert_no_leaks(nodes: list[Node], timeout_s: float = 10.0) -> None:
    """Every node's live counts return to zero (requests, tasks, contexts; on engine nodes also
    decoding rows, held KV and KV reservations). A count a node does not report is an error."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = {}
        for node in nodes:
            stats = node.stats()
            keys = LIVE_KEYS if node.role == "router" else LIVE_KEYS + ENGINE_KEYS
            held = {k: stats[k] for k in keys if stats[k]}
            if held:
                leaks[node.url] = held
        if not leaks:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaks: {json.dumps(leaks)}")
        time.sleep(0.1)


def outcomes(url: str) -> dict[tuple[str, str], float]:
    """statecore:requests_total on one node, by (state, reason): terminal states, and `rejected`
    for requests refused at intake."""
    found: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("statecore:requests_total{"):
            state = re.search(r'state="([^"]*)"', line)
            reason = re.search(r'reason="([^"]*)"', line)
            assert state and reason, line
            found[(state.group(1), reason.group(1))] = float(line.rsplit(" ", 1)[1])
    return found


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of a node's /metrics: the first of `name` whose labels include `labels`."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in {url}/metrics")


def post(node: Node, path: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
    return httpx.post(f"{node.url}{path}", json=body, timeout=timeout)


def stream_events(node: Node, path: str, body: dict[str, Any]) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    events: list[str] = []
    with httpx.stream("POST", f"{node.url}{path}", json=body, timeout=120.0) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    return events


def without_ids(doc: Any) -> Any:
    """A response body without `id` and `created`, the only fields allowed to differ."""
    if isinstance(doc, dict):
        return {k: without_ids(v) for k, v in doc.items() if k not in ("id", "created")}
    if isinstance(doc, list):
        return [without_ids(v) for v in doc]
    return doc


def rank_pid(node: Node, rank: int = 1) -> int:
    """The pid of a tensor- or pipeline-parallel instance's rank, from rank 0's log."""
    found = re.search(rf"started tensor-parallel rank {rank} of \d+ \(pid (\d+)\)", node.log.read_text())
    assert found, node.tail()
    return int(found.group(1))


def stream_killing_a_rank(node: Node, pid: int, after: int = 5,
                          killed: Callable[[], None] | None = None) -> tuple[list[Any], float]:
    """A long streamed completion on `node` whose rank `pid` is SIGKILLed after `after` events:
    the events received (the last one should be the typed error) and the seconds it took."""
    body = {"prompt": "A long story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    events: list[Any] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{node.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: "):]))
            if len(events) == after:
                os.kill(pid, signal.SIGKILL)
                if killed is not None:
                    killed()
    return events, time.monotonic() - started
