"""The no-argument local cluster as a new user meets it, one `statecore run` for the module (its
tests run in order; the last one stops it): it starts on the embedded demo model and answers a
chat with readable text; the start-up banner says which prompts go through the prefill node and
suggests the README's prompt, which really moves KV between the nodes; normal ends and
cancellations count as such on every node (never as failures); and Ctrl-C (SIGINT to the whole
process group, as a terminal sends it; SIGTERM takes the same way) drains every node under load,
finishes every stream and exits 0 with one line, leaving no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from adapters.blas import child_pids
from adapters.serve.flags import demo_model_dir
from adapters.serve.listeners import free_port
from tests.e2e.harness import ROOT, metric, outcomes

pytestmark = pytest.mark.e2e

STOP_LINE = "statecore: stopped on SIGINT: every node drained and stopped cleanly"
NODE_INFO = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (router|prefill|decode) +INFO ")  # a node's own log


@dataclass
class Cluster:
    process: subprocess.Popen[bytes]
    log: Path
    url: str
    children: list[int] = field(default_factory=list)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def interrupt(self) -> tuple[int, str]:
        """Ctrl-C: SIGINT to the launcher's whole process group. The exit code and the output
        that came after the signal."""
        before = len(self.log.read_bytes())
        os.killpg(self.process.pid, signal.SIGINT)
        code = self.process.wait(timeout=90)
        return code, self.log.read_bytes()[before:].decode(errors="replace")

    def assert_nothing_left(self) -> None:
        deadline = time.monotonic() + 10
        alive = self.children
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in self.children if _running(pid)]
            time.sleep(0.1)
        assert not alive, f"processes left behind: {alive}"


def _running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    assert (demo_model_dir() / "config.json").exists(), "the demo model ships with the package"
    port = free_port()
    log = tmp_path_factory.mktemp("demo") / "cluster.log"
    with log.open("wb") as out:
        # its own session, as a shell job is its own process group; --port only to stay clear
        # of other tests, everything else is the no-argument default
        process = subprocess.Popen([sys.executable, "-m", "adapters.cli", "run", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    running = Cluster(process, log, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 240
        while "Ctrl-C stops every node" not in running.text():
            assert process.poll() is None, running.text()
            assert time.monotonic() < deadline, running.text()
            time.sleep(0.2)
        running.children = child_pids(process.pid)
        assert len(running.children) == 3
        yield running
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in running.children:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def readme_handoff_body() -> dict[str, object]:
    """The request body of the README's curl that goes through the prefill node."""
    readme = (ROOT / "README.md").read_text()
    bodies = [json.loads(b) for b in re.findall(r"-d '(\{.*?\})'", readme, flags=re.S)]
    chosen: list[dict[str, object]] = [b for b in bodies if len(json.dumps(b)) > 300]
    assert chosen, "the README suggests no prompt long enough for a handoff"
    return chosen[0]


def wait_idle(urls: list[str]) -> None:
    deadline = time.monotonic() + 30
    while any(httpx.get(f"{u}/internal/stats", timeout=5).json()["live_requests"] for u in urls):
        assert time.monotonic() < deadline, "requests never settled"
        time.sleep(0.1)


def test_statecore_run_with_no_arguments_answers_a_chat(cluster: Cluster) -> None:
    text = cluster.text()
    assert cluster.url in text and "curl" in text, text
    assert "prompts of 64 tokens or more prefill on a prefill node" in text, text
    body = {"messages": [{"role": "user", "content": "Tell me a story about a king."}],
            "max_tokens": 60, "temperature": 0}
    r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    words = re.findall(r"[A-Za-z']+", answer)
    letters = sum(c.isalpha() or c.isspace() for c in answer)
    printable = all(c.isprintable() or c in "\n\t" for c in answer)
    assert len(words) >= 3 and letters >= 0.75 * len(answer) and printable, f"not readable: {answer!r}"


def test_the_readme_prompt_hands_off_and_ends_count_as_such_on_every_node(cluster: Cluster) -> None:
    body = readme_handoff_body()
    prefill = re.search(r"prefill (http://127\.0\.0\.1:\d+)", cluster.text())
    decode = re.search(r"decode (http://127\.0\.0\.1:\d+)", cluster.text())
    assert prefill and decode, cluster.text()
    assert body["messages"][0]["content"] in cluster.text(), "the banner suggests the README's prompt"  # type: ignore[index]
    reply = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    served = metric(prefill.group(1), "statecore:kv_transfer_bytes_total", direction="served")
    received = metric(decode.group(1), "statecore:kv_transfer_bytes_total", direction="received")
    assert served > 0 and received > 0, (served, received)

    # Normal ends and a cancellation, all through the prefill node: the same words on every
    # node, and none of them counted as a failure anywhere.
    greedy = {**body, "temperature": 0.0, "max_tokens": 40}
    text = httpx.post(f"{cluster.url}/v1/chat/completions", json=greedy, timeout=120).json()
    content = text["choices"][0]["message"]["content"]
    assert len(content) >= 12, f"the demo model's greedy reply is too short to cut: {content!r}"
    stop = httpx.post(f"{cluster.url}/v1/chat/completions", json={**greedy, "stop": content[6:10]},
                      timeout=120).json()
    assert stop["choices"][0]["finish_reason"] == "stop"
    one = httpx.post(f"{cluster.url}/v1/chat/completions", json={**greedy, "max_tokens": 1},
                     timeout=120).json()
    assert one["choices"][0]["finish_reason"] in ("length", "stop")
    with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", timeout=120,
                      json={**greedy, "stream": True, "max_tokens": 300}) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then hang up
    nodes = {"router": cluster.url, "prefill": prefill.group(1), "decode": decode.group(1)}
    wait_idle(list(nodes.values()))
    counted = {role: outcomes(url) for role, url in nodes.items()}
    for role, seen in counted.items():
        assert not [key for key, n in seen.items() if key[0] == "failed" and n], (role, seen)
    assert counted["router"].get(("cancelled", "cancelled")), counted
    assert counted["decode"].get(("cancelled", "cancelled")), counted
    assert counted["decode"].get(("done", "stop")), counted
    assert counted["prefill"].get(("done", "handed_off")), counted
    # the KV streamed to the decode node as it was computed: the prefill node's part ended handed
    # off, and the decode node ended the request at its first token with the router's reason
    assert counted["decode"].get(("done", one["choices"][0]["finish_reason"])), counted


def test_ctrl_c_under_load_finishes_every_stream_and_exits_0_with_one_line(cluster: Cluster) -> None:
    """Streams that have begun when Ctrl-C comes still end with [DONE]; then one line, exit 0."""
    body = readme_handoff_body()
    started = [threading.Event() for _ in range(4)]
    endings: list[str] = []

    def stream(begun: threading.Event) -> None:
        with httpx.stream("POST", f"{cluster.url}/v1/chat/completions", timeout=120,
                          json={**body, "stream": True, "max_tokens": 200, "temperature": 0.0}) as r:
            last = ""
            for line in r.iter_lines():
                if line.startswith("data: "):
                    begun.set()
                    last = line
            endings.append(last)

    threads = [threading.Thread(target=stream, args=(event,)) for event in started]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120), "a stream never began"
    code, after = cluster.interrupt()
    for thread in threads:
        thread.join(60)
    assert code == 0, cluster.text()[-3000:]
    assert endings == ["data: [DONE]"] * 4, endings
    # the nodes' INFO lines (requests ending, peers), then the one line of the stop: no warning,
    # no traceback, nothing else
    lines = [line for line in after.strip().splitlines() if not NODE_INFO.search(line)]
    assert lines == [STOP_LINE], after
    assert " peer " not in after, after  # a deliberate stop: the nodes going down is no news
    cluster.assert_nothing_left()
