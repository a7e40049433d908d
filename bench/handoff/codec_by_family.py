"""KV handoff figures per cache family at one prompt length (2,100 tokens by default), on CPU.

For each family and dtype: a prefill engine prefills the prompt and exports the held cache; the
payload is validated and rebuilt by the codec (`kv_wire.decode_cache`), re-encoded
(`kv_wire.encode_cache`; the bytes must equal the engine's export), installed into a second
engine, and decoded one step. Printed per row: wire bytes, raw live-tensor bytes and their
ratio; encode, decode/validate, install, first-decode-step and prefill milliseconds (medians of
--reps runs); and, on the same payload in the same run, a raw loopback baseline: the bytes through
`socket.socketpair()` (MB/s) next to the codec's encode+decode throughput.

    .venv/bin/python bench/handoff/codec_by_family.py [--families llama gemma3_text ...] [--json OUT]

Times:
- prefill: `MlxEngine.prefill` of the whole prompt (chunks of --chunk, then the last token).
- encode: `kv_wire.encode_cache` + joining the frames, on the bench thread.
- decode: `kv_wire.decode_cache`: framing, checksum, header schema, then the rebuilt caches.
- install: `MlxEngine.install` (the engine's own validation and rebuild, then into the decoder).
- first step: from install's return to the first decoded token on the stream.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import trio
from tokenizers import Tokenizer

from adapters.kv import codec
from adapters.mlx import MlxEngine
from effects.engine_port import SamplingParams
from statecore.ids import RequestId

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # support/: the tiny checkpoints
from support.tiny_models import CORPUS, FAMILIES, cached_checkpoint

ONE_TOKEN = SamplingParams(max_tokens=2)  # the first token, then one decode step


@dataclass(frozen=True, slots=True)
class Row:
    family: str
    dtype: str
    tokens: int
    wire_bytes: int
    raw_bytes: int
    ratio: float
    classes: str
    encode_ms: float
    decode_ms: float
    install_ms: float
    first_step_ms: float
    prefill_ms: float
    codec_mb_s: float  # wire bytes / (encode + decode)
    loopback_mb_s: float  # the same bytes through a local socket pair


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def loopback_ms(payload: bytes, reps: int) -> float:
    """Median ms from the first byte sent to the last byte received over a socketpair.

    A sender thread (started before the clock) `sendall`s the payload; this thread `recv_into`s
    a preallocated buffer: no framing, no checksum, no copies but the kernel's.
    """
    sink = memoryview(bytearray(len(payload)))
    times: list[float] = []
    for _ in range(reps + 1):  # the first one warms up
        left, right = socket.socketpair()
        with left, right:
            go = threading.Event()

            def send(sock: socket.socket = left, go: threading.Event = go) -> None:
                go.wait()
                sock.sendall(payload)

            sender = threading.Thread(target=send)
            sender.start()
            start = time.perf_counter()
            go.set()
            got = 0
            while got < len(payload):
                n = right.recv_into(sink[got:], len(payload) - got)
                if n == 0:
                    raise ConnectionError("loopback closed early")
                got += n
            times.append(time.perf_counter() - start)
            sender.join()
    return statistics.median(times[1:]) * 1e3


def prompt_ids(model_dir: Path, n: int) -> list[int]:
    ids: list[int] = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(CORPUS * 4).ids
    return ids[:n]


async def measure(family: str, dtype: str, args: argparse.Namespace) -> Row:
    size: dict[str, Any] = {}  # the tests' checkpoints unless asked otherwise
    if (args.hidden_size, args.num_layers) != (64, 2):
        size = {"hidden_size": args.hidden_size, "num_layers": args.num_layers}
    model_dir = cached_checkpoint(family, dtype=dtype, **size)
    prompt = prompt_ids(model_dir, args.tokens)
    prefill_node = await MlxEngine.load(model_dir, prefill_chunk_size=args.chunk)
    decode_node = await MlxEngine.load(model_dir, prefill_chunk_size=args.chunk)
    try:
        info = decode_node.info
        classes = ",".join(sorted({layer.class_name for layer in info.layers}))
        prefill_s: list[float] = []
        install_s: list[float] = []
        first_step_s: list[float] = []
        payload = b""
        for rep in range(args.reps + 1):  # rep 0 warms both engines up and is not counted
            rid = RequestId(f"r{rep}")
            start = time.perf_counter()
            outcome = await prefill_node.prefill(rid, prompt, ONE_TOKEN)
            prefill_s.append(time.perf_counter() - start)
            payload = (await prefill_node.export_held(rid)).joined()
            await prefill_node.release_held(rid)

            start = time.perf_counter()
            await decode_node.install(rid, payload, prompt, outcome.first_token, ONE_TOKEN)
            installed = time.perf_counter()
            async for _ in decode_node.stream(rid):
                first_step_s.append(time.perf_counter() - installed)
                break
            install_s.append(installed - start)
            await decode_node.cancel(rid)
        del prefill_s[0], install_s[0], first_step_s[0]

        # The codec alone, on this thread (it evaluates every array it builds, here).
        decoded = codec.decode_cache(payload, fingerprint=info.fingerprint)
        raw = codec.raw_tensor_bytes(decoded.caches)

        def encode() -> bytes:
            frames = codec.encode_cache(
                decoded.caches, fingerprint=info.fingerprint, token_count=len(prompt)
            )
            return b"".join(frames)

        if encode() != payload:
            raise AssertionError(f"{family}/{dtype}: re-encoding the decoded caches changed the bytes")
        encode_ms = _median_ms(encode, args.reps * 5)
        decode_ms = _median_ms(
            lambda: codec.decode_cache(payload, fingerprint=info.fingerprint), args.reps * 5
        )
        socket_ms = loopback_ms(payload, args.reps * 5)
    finally:
        await prefill_node.aclose()
        await decode_node.aclose()
    mb = len(payload) / 1e6
    return Row(
        family=family,
        dtype=dtype,
        tokens=len(prompt),
        wire_bytes=len(payload),
        raw_bytes=raw,
        ratio=len(payload) / raw,
        classes=classes,
        encode_ms=encode_ms,
        decode_ms=decode_ms,
        install_ms=statistics.median(install_s) * 1e3,
        first_step_ms=statistics.median(first_step_s) * 1e3,
        prefill_ms=statistics.median(prefill_s) * 1e3,
        codec_mb_s=mb / ((encode_ms + decode_ms) / 1e3),
        loopback_mb_s=mb / (socket_ms / 1e3),
    )


def machine() -> str:
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), "
        f"Python {platform.python_version()}, mlx {version('mlx')} ({mx.default_device()})"
    )


def table(rows: list[Row]) -> str:
    head = (
        "| family | dtype | caches | wire bytes | raw bytes | ratio | encode ms | decode ms | install ms "
        "| 1st step ms | prefill ms | codec MB/s | loopback MB/s |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r.family} | {r.dtype} | {r.classes} | {r.wire_bytes:,} | {r.raw_bytes:,} | {r.ratio:.4f} "
            f"| {r.encode_ms:.2f} | {r.decode_ms:.2f} | {r.install_ms:.2f} | {r.first_step_ms:.2f} "
            f"| {r.prefill_ms:.0f} | {r.codec_mb_s:,.0f} | {r.loopback_mb_s:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    dtypes = ("float32", "bfloat16", "float16")
    parser.add_argument("--dtypes", nargs="+", choices=dtypes, default=list(dtypes[:2]))
    parser.add_argument("--tokens", type=int, default=2100)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk size (the engine's default)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument(
        "--reps", type=int, default=3, help="repetitions; the codec and the socket get 5x as many"
    )
    parser.add_argument("--json", type=Path, help="also write the rows (and the machine) here")
    args = parser.parse_args(argv)

    started = dt.datetime.now(dt.UTC)
    print(
        f"# KV handoff per family: {args.tokens} tokens, tiny models hidden {args.hidden_size} x "
        f"{args.num_layers} layers, chunk {args.chunk}, medians of {args.reps} "
        f"(codec and socket: {5 * args.reps})"
    )
    print(f"# {machine()}; {started:%Y-%m-%d %H:%M} UTC")
    rows: list[Row] = []
    for family in args.families:
        for dtype in args.dtypes:
            row = trio.run(measure, family, dtype, args)
            rows.append(row)
            print(f"  {family}/{dtype}: {row.wire_bytes:,} bytes, ratio {row.ratio:.4f}", file=sys.stderr)
    print(table(rows))
    if args.json is not None:
        report: dict[str, Any] = {
            "machine": machine(),
            "date": started.isoformat(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
