"""Where a same-host handoff's time goes per stage, on this machine's device (the GPU on CUDA).

A 1B-shaped cache (Llama-3.2-1B: 16 layers, 8 KV heads of 64, bf16: 32 KiB a token) of --tokens
tokens is computed on the device, then moved the way a streamed handoff through shared memory
moves it, one stage at a time, each timed alone (median of --reps, after a warm-up):

- `to host views`: `codec.host_tensors` (numpy views of the arrays' memory);
- `copy into shm`: `ShmOutbox.put` of the unsealed pieces (the device-to-host copy happens here
  on CUDA, where the arrays live in the device's memory), and `copy again`, the same views once
  more (a plain host copy: what the first one costs beyond memcpy);
- `crc one core` (`zlib.crc32`) and `crc parallel` (`adapters.kv.checksum.crc32`, the one the
  wire format uses), each over the same bytes;
- `validate`: `codec.validate_payload` of the payload read back from shared memory (its CRC);
- `build`: `codec.build_caches` (the host-to-device copy, evaluated);
- `end to end, N pieces`: the cache cut into N layer ranges, each through put -> read ->
  validate -> build, one after another, as the node does it today, and with a sender thread
  putting the next piece while the receiver works on the one before (the two nodes' overlap).

    python3 bench/handoff/kv_copy_stages.py --tokens 2000 8000     # on the GPU machine, ~1 min

Bench code: it may import anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from mlx_lm.models.cache import KVCache

from adapters.kv import checksum, codec, frames
from adapters.kv.shm_inbox import ShmInbox
from adapters.kv.shm_outbox import ShmOutbox

LAYERS, KV_HEADS, HEAD_DIM = 16, 8, 64
FINGERPRINT = "kv-copy-stages"


def cache_of(tokens: int, seed: int) -> list[Any]:
    mx.random.seed(seed)
    layers = []
    for _ in range(LAYERS):
        keys = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM)).astype(mx.bfloat16)
        values = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM)).astype(mx.bfloat16)
        cache = KVCache()
        cache.update_and_fetch(keys, values)
        layers.append(cache)
    mx.eval([a for c in layers for a in (c.keys, c.values)])
    return layers


def timed(reps: int, make: Callable[[], Any], work: Callable[[Any], Any]) -> float:
    """Median seconds of `work(make())` (make untimed), after one untimed warm-up."""
    work(make())
    times = []
    for _ in range(reps):
        given = make()
        started = time.perf_counter()
        work(given)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def stages(tokens: int, reps: int, outbox: ShmOutbox, inbox: ShmInbox) -> list[tuple[str, float, int]]:
    seeds = iter(range(10**6))
    nbytes = tokens * LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    rows: list[tuple[str, float, int]] = []

    def fresh() -> list[Any]:
        return cache_of(tokens, next(seeds))  # new device arrays: nothing host-resident yet

    def views(caches: list[Any]) -> frames.HostTensors:
        return codec.host_tensors(caches, fingerprint=FINGERPRINT, token_count=tokens)

    rows.append(("to host views", timed(reps, fresh, views), nbytes))

    def put(tensors: frames.HostTensors) -> Any:
        ref = outbox.put("r", [*frames.unsealed_pieces(tensors), frames.end_frame(tensors)])
        outbox.free(ref)

    def put_unsealed(tensors: frames.HostTensors) -> None:
        outbox.free(outbox.put("r", frames.unsealed_pieces(tensors)))

    rows.append(("copy into shm (first touch)", timed(reps, lambda: views(fresh()), put_unsealed), nbytes))
    held = views(fresh())
    rows.append(("copy into shm again", timed(reps, lambda: held, put_unsealed), nbytes))
    rows.append(("crc one core", timed(reps, lambda: held, lambda t: [zlib.crc32(v) for v in t.runs]),
                 nbytes))
    rows.append(("crc parallel", timed(reps, lambda: held, lambda t: checksum.crc32(t.runs)), nbytes))
    rows.append(("crc parallel (first touch)", timed(reps, lambda: views(fresh()),
                                                     lambda t: checksum.crc32(t.runs)), nbytes))

    rows.extend(receiving(held, reps, outbox, inbox, nbytes))
    for pieces in (1, 4, 16):
        per = LAYERS // pieces
        rows.append((f"end to end, {pieces} pieces, one after another",
                     timed(reps, fresh, lambda caches, per=per: serial(caches, per, tokens, outbox, inbox)),
                     nbytes))
        rows.append((f"end to end, {pieces} pieces, sender overlapped",
                     timed(reps, fresh,
                           lambda caches, per=per: overlapped(caches, per, tokens, outbox, inbox)),
                     nbytes))
    return rows


def receiving(held: frames.HostTensors, reps: int, outbox: ShmOutbox, inbox: ShmInbox,
              nbytes: int) -> list[tuple[str, float, int]]:
    ref = outbox.put("p", [*frames.unsealed_pieces(held), frames.end_frame(held)])
    payload = inbox.read(ref)
    validated = codec.validate_payload(payload, fingerprint=FINGERPRINT)
    rows = [("validate (crc parallel)",
             timed(reps, lambda: payload, lambda p: codec.validate_payload(p, fingerprint=FINGERPRINT)),
             nbytes),
            ("build (host to device)", timed(reps, lambda: validated, codec.build_caches), nbytes)]
    inbox.done(ref)
    outbox.free(ref)
    return rows


def take_piece(ref: Any, outbox: ShmOutbox, inbox: ShmInbox) -> None:
    """The receiver's part: read, validate, build (host to device), release."""
    view = inbox.read(ref)
    codec.build_caches(codec.validate_payload(view, fingerprint=FINGERPRINT))
    inbox.done(ref)
    outbox.free(ref)


def serial(caches: list[Any], per: int, tokens: int, outbox: ShmOutbox, inbox: ShmInbox) -> None:
    for first in range(0, LAYERS, per):
        tensors = codec.host_tensors(caches[first:first + per], fingerprint=FINGERPRINT, token_count=tokens)
        take_piece(outbox.put(f"e{first}", [*frames.unsealed_pieces(tensors), frames.end_frame(tensors)]),
                   outbox, inbox)


def overlapped(caches: list[Any], per: int, tokens: int, outbox: ShmOutbox, inbox: ShmInbox) -> None:
    refs: queue.Queue[Any] = queue.Queue()

    def send() -> None:
        for first in range(0, LAYERS, per):
            tensors = codec.host_tensors(caches[first:first + per], fingerprint=FINGERPRINT,
                                         token_count=tokens)
            seal = frames.end_frame_in_background(tensors)
            refs.put(outbox.put(f"o{first}", [*frames.unsealed_pieces(tensors), seal()]))
        refs.put(None)

    sender = threading.Thread(target=send)
    sender.start()
    while (ref := refs.get()) is not None:
        take_piece(ref, outbox, inbox)
    sender.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"# device {mx.default_device()}, mlx {mx.__version__}, crc workers {checksum._WORKERS}; "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    outbox, inbox = ShmOutbox(max_bytes=4 << 30, checksum=False), ShmInbox()
    try:
        for tokens in args.tokens:
            print(f"\n| {tokens} tokens | ms | GB/s |\n|---|---|---|")
            for name, seconds, nbytes in stages(tokens, args.reps, outbox, inbox):
                print(f"| {name} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.2f} |")
    finally:
        outbox.close()
        inbox.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
