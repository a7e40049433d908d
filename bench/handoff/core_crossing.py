"""What a streamed piece of KV costs to cross from a prefill node's engine core process (`--engine-core
process`) to a decode node through shared memory, per payload size: the bytes copied and the time
of each copy, with the nodes copying as they did before they handed the core's region on
(the rows `before`) and as they do now (`now`), both in every run.

The piece is a 1B-shaped cache (Llama-3.2-1B: 16 layers, 8 KV heads of 64, bf16: 32 KiB a token)
framed as the core frames it (`kv_out.pieces_of` over `codec.host_tensors`), then:

- `core: copy into shm`: the core's one copy into its region (`ShmOutbox.put` of the pieces and
  the end frame, as `CoreServer._put` does; the device-to-host copy on CUDA);
- `prefill node`: the node reads the core's region in place and its `SegmentCopies` (the real one,
  in trio) either copies the piece into the node's own region (before) or hands the core's region
  on (now: `KvPieces.shared`);
- `decode node (process core)`: the decode node either copies the piece it read in the prefill
  side's region into its own for its core (`ProcessEngine._share`, before) or hands that region's
  reference to its core (now); the core reads it in place either way.

Each timed stage is the median of --reps after a warm-up; the box's load is printed (a shared box:
compare the rows of one run).

    .venv/bin/python bench/handoff/core_crossing.py --mib 64 256

Bench code: it may import anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


from adapters.http.segment_copies import SegmentCopies
from adapters.kv import codec
from adapters.kv.shm_inbox import ShmInbox
from adapters.kv.shm_outbox import ShmOutbox
from adapters.kv.shm_region import ShmRef
from adapters.mlx.kv_out import pieces_of
from effects.engine_port import KvPieces, KvSegment
from statecore.ids import RequestId

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_copy_stages import HEAD_DIM, KV_HEADS, LAYERS, cache_of  # the same 1B-shaped cache

TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
FINGERPRINT = "core-crossing"


def median_s(reps: int, work: Callable[[], Any]) -> float:
    work()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def through_segment_copies(outbox: ShmOutbox, segment: KvSegment) -> ShmRef | None:
    """The prefill node's stream: `SegmentCopies.start`, then its first finished piece."""
    async def run() -> ShmRef | None:
        copies = SegmentCopies(outbox, RequestId("bench"))
        copies.start(segment)
        while (done := copies.finished()) is None:
            await trio.sleep(0.0005)
        return done[1]

    return trio.run(run)


def rows_for(mib: int, reps: int, before: bool) -> list[tuple[str, float, int]]:
    tokens = mib * (1 << 20) // TOKEN_BYTES
    caches = cache_of(tokens, seed=0)
    core_outbox = ShmOutbox(max_bytes=4 << 30, checksum=False)
    node_outbox = ShmOutbox(max_bytes=4 << 30, checksum=False)
    decode_node_outbox = ShmOutbox(max_bytes=4 << 30, checksum=False)
    inbox = ShmInbox()
    rows: list[tuple[str, float, int]] = []
    payload = pieces_of(codec.host_tensors(caches, fingerprint=FINGERPRINT, token_count=tokens))
    nbytes = payload.nbytes
    core_refs: list[ShmRef] = []

    def core_copy() -> None:
        seal = payload.seal() if payload.seal is not None else b""
        pieces = [memoryview(piece) for piece in payload.pieces]
        core_refs.append(core_outbox.put("bench", [*pieces, memoryview(seal)]))
        if len(core_refs) > 1:
            core_outbox.free(core_refs.pop(0))

    rows.append(("core: copy into shm", median_s(reps, core_copy), nbytes))
    ref = core_refs[-1]
    view = inbox.read(ref)
    from_core = KvPieces((view,), shared=None if before else ref)
    segment = KvSegment(0, tokens, 0, LAYERS, from_core)

    def prefill_node() -> None:
        handed = through_segment_copies(node_outbox, segment)
        if handed is not None and handed != ref:
            node_outbox.free(handed)

    rows.append(("prefill node: the piece to the decode node", median_s(reps, prefill_node),
                 0 if not before else nbytes))

    def decode_node() -> None:
        if before or from_core.shared is None:  # what ProcessEngine._share did with every piece
            decode_node_outbox.free(decode_node_outbox.put("bench", [view]))

    rows.append(("decode node: the piece to its process core", median_s(reps, decode_node),
                 nbytes if before else 0))
    view.release()
    for box in (core_outbox, node_outbox, decode_node_outbox):
        box.close()
    inbox.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"device {mx.default_device()}; load average {os.getloadavg()[0]:.2f}")
    for mib in args.mib:
        for before in (True, False):
            label = "before (nodes copy)" if before else "now (regions handed on)"
            for stage, seconds, copied in rows_for(mib, args.reps, before):
                print(f"{mib:4d} MiB  {label:24s} {stage:44s} {seconds * 1e3:8.1f} ms  "
                      f"copied {copied / (1 << 20):6.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
