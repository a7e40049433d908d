"""The default KV budget (`--kv-memory-bytes` not given) on each backend's description of its
device: MLX names the device's memory `memory_size` on Metal and `total_memory` on CUDA (a
budget read from the host's RAM instead once made an 80 GB GPU run out of memory under load),
the weights come off the usable part first, and engine nodes sharing one device split it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from adapters.mlx import memory
from adapters.mlx.memory import (
    DEFAULT_KV_MEMORY_FRACTION,
    DEVICE_USABLE_FRACTION,
    default_kv_memory_bytes,
    device_memory_bytes,
)

pytestmark = pytest.mark.quick
GIB = 1 << 30


def describe_device(monkeypatch: pytest.MonkeyPatch, info: dict[str, Any]) -> None:
    monkeypatch.setattr(mx, "device_info", lambda: info)


def weights_of(tmp_path: Path, nbytes: int) -> Path:
    with (tmp_path / "model.safetensors").open("wb") as out:
        out.truncate(nbytes)  # sparse: only its size is read
    return tmp_path


@pytest.mark.parametrize("key", ["memory_size", "total_memory"])
def test_the_devices_memory_under_either_name(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    describe_device(monkeypatch, {key: 80 * GIB, "free_memory": 79 * GIB})
    assert device_memory_bytes() == 80 * GIB
    assert default_kv_memory_bytes() == int(80 * GIB * DEFAULT_KV_MEMORY_FRACTION)


def test_no_device_memory_named_means_the_machines_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    describe_device(monkeypatch, {})
    assert device_memory_bytes() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_weights_come_off_the_usable_part_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    describe_device(monkeypatch, {"total_memory": 24 * GIB})
    model = weights_of(tmp_path, 16 * GIB)
    assert default_kv_memory_bytes(model) == int(24 * GIB * DEVICE_USABLE_FRACTION) - 16 * GIB
    small = weights_of(tmp_path, 1 * GIB)
    assert default_kv_memory_bytes(small) == int(24 * GIB * DEFAULT_KV_MEMORY_FRACTION)


def test_nodes_sharing_a_device_split_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    describe_device(monkeypatch, {"total_memory": 80 * GIB})
    model = weights_of(tmp_path, 3 * GIB)
    alone, shared = default_kv_memory_bytes(model), default_kv_memory_bytes(model, shared_by=2)
    assert shared == alone // 2
    # both nodes' weights and KV together stay within the usable part
    assert 2 * (3 * GIB + shared) <= 80 * GIB * DEVICE_USABLE_FRACTION


def test_this_backend_names_a_size() -> None:
    assert device_memory_bytes() > 0 and default_kv_memory_bytes() > 0
    assert isinstance(mx.device_info(), dict)


def test_an_out_of_memory_says_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    describe_device(monkeypatch, {"total_memory": 80 * GIB})
    cuda = RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
    metal = RuntimeError("[malloc] Unable to allocate 17179869184 bytes.")
    for exc in (cuda, metal):
        advice = memory.out_of_memory_advice(exc, 51 * GIB)
        assert advice is not None and "--kv-memory-bytes" in advice and "51.0 GiB" in advice, advice
    assert memory.out_of_memory_advice(RuntimeError("shapes do not broadcast"), GIB) is None
    assert memory.out_of_memory_advice(MemoryError(), GIB) is None  # the host's, not the device's


def test_processes_sharing_a_device_bound_their_allocators(monkeypatch: pytest.MonkeyPatch) -> None:
    describe_device(monkeypatch, {"total_memory": 80 * GIB})
    limits: list[int] = []

    def set_memory_limit(limit: int) -> int:
        limits.append(limit)
        return 0

    monkeypatch.setattr(mx, "set_memory_limit", set_memory_limit)
    assert memory.share_the_device(1) is None and limits == []  # alone: MLX's default stays
    assert memory.share_the_device(2) == limits[-1] == int(80 * GIB * memory.ALLOCATOR_FRACTION) // 2
