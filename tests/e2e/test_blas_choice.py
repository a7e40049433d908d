"""`statecore run --blas` on real processes: what /proc/<pid>/maps and /internal/info show.

Never skipped: where the system OpenBLAS is missing, `--blas openblas` must exit with the
install hint instead, and `auto` must fall back to the bundled BLAS.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from adapters.blas import (
    INSTALL_HINT,
    SHORT_SPIN,
    SPIN_ENV,
    blas_of_process_tree,
    blas_threads,
    find_openblas,
    mapped_blas,
    system_openblas_mapped,
)
from tests.e2e.harness import Node

pytestmark = pytest.mark.e2e

OPENBLAS = find_openblas()


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def _reported_blas(node: Node) -> str:
    blas: str = httpx.get(f"{node.url}/internal/info", timeout=5.0).json()["blas"]
    return blas


def test_openblas_and_bundled_single_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `bundled` started with OpenBLAS preloaded in its environment (as a user following older docs
    # would): the node must drop the preload, not just ignore it.
    if OPENBLAS is not None:
        monkeypatch.setenv("LD_PRELOAD", str(OPENBLAS))
    bundled = Node("single", ["--blas", "bundled"], tmp_path / "bundled.log")
    bundled.start()
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    openblas = Node("single", ["--blas", "openblas"], tmp_path / "openblas.log")
    openblas.start()
    try:
        bundled.wait_healthy()
        assert bundled.process is not None and openblas.process is not None
        assert not system_openblas_mapped(bundled.process.pid), mapped_blas(bundled.process.pid)
        assert _reported_blas(bundled) == "bundled"
        if OPENBLAS is None:
            assert openblas.process.wait(timeout=60) != 0
            assert INSTALL_HINT in openblas.tail()
        else:
            openblas.wait_healthy()
            # the same pid as started: the re-exec replaced the process image, not the process
            assert system_openblas_mapped(openblas.process.pid), mapped_blas(openblas.process.pid)
            one = blas_threads(len(os.sched_getaffinity(0)), {}) == 1  # and the fingerprint says so
            assert _reported_blas(openblas) == ("openblas-1thread" if one else "openblas")
    finally:
        assert bundled.stop() == 0
        openblas.stop()


def test_cluster_engine_nodes_share_one_blas(tmp_path: Path) -> None:
    cluster = Node("cluster", [], tmp_path / "cluster.log")
    cluster.start()
    try:
        cluster.wait_healthy()  # the router is up only after prefill and decode are healthy
        assert cluster.process is not None
        blas = blas_of_process_tree(cluster.process.pid)
        assert sorted(name.split()[0] for name in blas) == ["decode", "prefill"], blas
        assert set(blas.values()) == {"bundled" if OPENBLAS is None else "openblas"}, blas
        if OPENBLAS is not None:  # the two share the cores; idle workers sleep after a short spin
            share = str(blas_threads(len(os.sched_getaffinity(0)), {}, engine_nodes=2))
            for name in blas:
                environ = _environ(int(name.split("pid ")[1].rstrip(")")))
                settings = (environ.get("OPENBLAS_NUM_THREADS"), environ.get(SPIN_ENV))
                assert settings == (share, SHORT_SPIN), name
    finally:
        assert cluster.stop() == 0, cluster.tail()
