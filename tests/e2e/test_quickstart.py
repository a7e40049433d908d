"""`statecore run` with no arguments: a local cluster on the embedded demo model that answers a
chat request with readable text, and stops every child cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from adapters.blas import child_pids
from adapters.serve.flags import demo_model_dir
from adapters.serve.listeners import free_port
from tests.e2e.harness import ROOT

pytestmark = pytest.mark.e2e


def test_statecore_run_with_no_arguments_answers_a_chat(tmp_path: Path) -> None:
    assert (demo_model_dir() / "config.json").exists(), "the demo model ships with the package"
    port = free_port()
    log = tmp_path / "cluster.log"
    with log.open("wb") as out:
        # `--port` only to stay clear of other tests; everything else is the no-argument default
        parent = subprocess.Popen([sys.executable, "-m", "adapters.cli", "run", "--port", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while "cluster ready" not in log.read_text():
            assert parent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        text = log.read_text()
        assert f"http://127.0.0.1:{port}" in text and "curl" in text
        children = child_pids(parent.pid)
        assert len(children) == 3
        body = {"messages": [{"role": "user", "content": "Tell me a story about a king."}],
                "max_tokens": 60, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        words = re.findall(r"[A-Za-z']+", answer)
        letters = sum(c.isalpha() or c.isspace() for c in answer)
        printable = all(c.isprintable() or c in "\n\t" for c in answer)
        assert len(words) >= 3 and letters >= 0.75 * len(answer) and printable, f"not readable: {answer!r}"
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0, log.read_text()[-3000:]
        for pid in children:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
