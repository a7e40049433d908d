"""Shared memory for KV (`adapters.kv.shm_outbox`, `shm_inbox`) across two processes: a producer in
a child, the consumer here.

The child (this file run as a script) makes a `ShmOutbox` in a directory of the test's own,
puts a known payload, prints its advert and the reference as one JSON line, then serves
commands from stdin ("free" / "exit") until it is stopped. The test reads the bytes through a
`ShmInbox`, then stops the child the ways a node stops: cleanly, by SIGTERM (a node drains and
exits, so its exit handlers run: the child does the same), and by SIGKILL (nothing runs: the
next reader gets `kv_shm_gone` and unlinks the orphan, and `sweep_orphans` removes the rest).
Every wait polls a condition under a deadline; none sleeps a fixed time.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters.kv.shm_inbox import ShmInbox, same_host
from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import default_directory, parse_advert, parse_ref, sweep_orphans
from statecore.errors import Code, StatecoreError

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60.0
PAYLOAD_BYTES = 3 << 20


def _payload() -> bytes:
    return bytes(range(256)) * (PAYLOAD_BYTES // 256)


# --------------------------------------------------------------------------- the child


def _child(directory: str) -> int:
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # as a node: drain, exit 0
    outbox = ShmOutbox(max_bytes=16 << 20, directory=directory)
    ref = outbox.put("r1", [_payload()])
    print(json.dumps({"advert": outbox.advert().model_dump(), "ref": ref.model_dump()}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "free":
            print(json.dumps({"freed": outbox.free(ref)}), flush=True)
        elif command == "exit":
            outbox.close()
            return 0
    return 0


# --------------------------------------------------------------------------- the test's side


@pytest.fixture
def where() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="statecore-test-", dir=default_directory()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def child(where: Path) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, __file__, str(where)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=DEADLINE_S)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    proc.stdout.close()


def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
    assert ready, f"the child said nothing within {DEADLINE_S} s"
    line = proc.stdout.readline()
    assert line, f"the child exited ({proc.poll()}) without a line"
    document: dict[str, Any] = json.loads(line)
    return document


def _send(proc: subprocess.Popen[str], command: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


def _wait_until_empty(where: Path) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while os.listdir(where) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the condition, bounded by the deadline
    assert os.listdir(where) == []


def test_bytes_cross_processes_and_a_clean_exit_leaves_nothing(
        where: Path, child: subprocess.Popen[str]) -> None:
    started = _line(child)
    advert = parse_advert(started["advert"])
    assert advert is not None and same_host(advert)
    ref = parse_ref(started["ref"])
    inbox = ShmInbox(advert.directory)
    try:
        view = inbox.read(ref)
        assert bytes(view) == _payload()
        view.release()
        inbox.done(ref)
        _send(child, "free")
        assert _line(child) == {"freed": True}
        with pytest.raises(StatecoreError) as excinfo:  # freed: the old reference is stale
            inbox.read(ref)
        assert excinfo.value.info.code is Code.KV_SHM_GONE
        _send(child, "exit")
        assert child.wait(timeout=DEADLINE_S) == 0
        _wait_until_empty(where)
        assert not same_host(advert)
    finally:
        inbox.close()


def test_sigterm_leaves_nothing_in_shared_memory(where: Path, child: subprocess.Popen[str]) -> None:
    started = _line(child)
    ref = parse_ref(started["ref"])
    inbox = ShmInbox(where)
    try:
        inbox.read(ref).release()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=DEADLINE_S) == 0
        _wait_until_empty(where)
        with pytest.raises(StatecoreError) as excinfo:  # mapped here, but its file is gone
            inbox.read(ref)
        assert excinfo.value.info.code is Code.KV_SHM_GONE
    finally:
        inbox.close()


@pytest.mark.parametrize("mapped_before", [False, True])
def test_a_killed_producer_is_a_typed_error_and_its_orphans_are_swept(
        where: Path, child: subprocess.Popen[str], mapped_before: bool) -> None:
    started = _line(child)
    advert = parse_advert(started["advert"])
    ref = parse_ref(started["ref"])
    assert advert is not None
    inbox = ShmInbox(where)
    try:
        if mapped_before:
            inbox.read(ref).release()
        child.kill()
        child.wait(timeout=DEADLINE_S)
        assert ref.region in os.listdir(where)  # SIGKILL: nothing ran
        with pytest.raises(StatecoreError) as excinfo:
            inbox.read(ref)
        assert excinfo.value.info.code is Code.KV_SHM_GONE
        assert "is gone" in str(excinfo.value)
        assert ref.region not in os.listdir(where)  # the reader unlinked the orphan
        assert not same_host(advert)
        assert sweep_orphans(where) == [advert.probe]
        assert os.listdir(where) == []
    finally:
        inbox.close()


def test_a_new_outbox_sweeps_a_killed_one(where: Path, child: subprocess.Popen[str]) -> None:
    _line(child)
    child.kill()
    child.wait(timeout=DEADLINE_S)
    assert len(os.listdir(where)) == 2  # the region and the probe
    successor = ShmOutbox(max_bytes=4 << 20, directory=where)
    try:
        assert sorted(os.listdir(where)) == successor.region_names()
    finally:
        successor.close()
    assert os.listdir(where) == []


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1]))
