"""What a process boundary between the trio front end and the engine core would cost per step.

The engine core in its own process (issue 32, item 4) would send each step's tokens to the front
end and take commands back: one message each way per step. This times that round trip between two
processes, with no model, for a step of B rows (each row: its slot, its token, a finish flag, its
logprob), B in --batch:

- `pipe+struct`: an os.pipe each way, a length-prefixed message packed with `struct` (fixed layout,
  no per-row objects beyond the tuple the reader unpacks);
- `mp.Pipe`: multiprocessing's Connection (pickle of a list of tuples), the naive choice;
- `shm+doorbell`: the message written into a shared-memory ring, one byte over a pipe to wake the
  reader (what a ring costs when neither side may spin);
- `shm+spin`: the same ring, the reader polling its sequence counter (the lowest latency, at the
  price of a core spinning on each side: on a 2-core box that is the model's core).

For each: round trip p50 / p99 in microseconds, and the front end's CPU time per round trip (what
the front end pays per step: the part that competes with HTTP work for its GIL). One JSON line per
(transport, batch), and a summary.

    .venv/bin/python bench/engine/core_channel.py --batch 8,32 --rounds 20000

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import struct
import sys
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

HEADER = struct.Struct("<QI")  # step number, rows


def row_format(batch: int) -> struct.Struct:
    """A step's rows as columns: slots (uint32), tokens (int32), finish flags (uint8), logprobs (float32)."""
    return struct.Struct(f"<{batch}I{batch}i{batch}B{batch}f")


def step_values(step: int, batch: int) -> list[Any]:
    return [*range(batch), *[(step * 31 + i) % 128_000 for i in range(batch)], *([0] * batch),
            *([-0.5] * batch)]


# -- pipe + struct -------------------------------------------------------------------------------

def _read_exact(fd: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def core_pipe(read_fd: int, write_fd: int, batch: int, rounds: int) -> None:
    rows = row_format(batch)
    for step in range(rounds):
        body = rows.pack(*step_values(step, batch))
        os.write(write_fd, HEADER.pack(step, batch) + body)
        _read_exact(read_fd, HEADER.size)  # the front end's commands for the next step (none)


def front_pipe(read_fd: int, write_fd: int, batch: int, rounds: int) -> list[float]:
    rows = row_format(batch)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step, count = HEADER.unpack(_read_exact(read_fd, HEADER.size))
        values = rows.unpack(_read_exact(read_fd, rows.size))
        tokens = list(zip(values[:count], values[count:2 * count], strict=True))
        assert len(tokens) == batch
        os.write(write_fd, HEADER.pack(step, 0))
        times.append(time.perf_counter() - t0)
    return times


# -- multiprocessing.Pipe (pickle) ---------------------------------------------------------------

def core_mp(conn: Connection, batch: int, rounds: int) -> None:
    for step in range(rounds):
        values = step_values(step, batch)
        conn.send((step, [(values[i], values[batch + i], False, -0.5) for i in range(batch)]))
        conn.recv()


def front_mp(conn: Connection, batch: int, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step, rows = conn.recv()
        assert len(rows) == batch
        conn.send((step, ()))
        times.append(time.perf_counter() - t0)
    return times


# -- a shared-memory ring: one slot each way, a sequence number before the body ------------------

SEQ = struct.Struct("<Q")


def core_shm(name: str, bell_read: int, bell_write: int, batch: int, rounds: int, spin: bool) -> None:
    ring = shared_memory.SharedMemory(name=name)
    buf = ring.buf
    assert buf is not None
    rows = row_format(batch)
    down, up = 0, 4096  # core -> front end at 0, front end -> core at 4096
    for step in range(rounds):
        rows.pack_into(buf, down + SEQ.size + HEADER.size, *step_values(step, batch))
        HEADER.pack_into(buf, down + SEQ.size, step, batch)
        SEQ.pack_into(buf, down, step + 1)  # published last
        if not spin:
            os.write(bell_write, b"x")
            os.read(bell_read, 1)
        else:
            while SEQ.unpack_from(buf, up)[0] != step + 1:
                pass
    del buf
    ring.close()


def front_shm(name: str, bell_read: int, bell_write: int, batch: int, rounds: int, spin: bool) -> list[float]:
    ring = shared_memory.SharedMemory(name=name)
    buf = ring.buf
    assert buf is not None
    rows = row_format(batch)
    down, up = 0, 4096
    times = []
    for step in range(rounds):
        t0 = time.perf_counter()
        if not spin:
            os.read(bell_read, 1)
        else:
            while SEQ.unpack_from(buf, down)[0] != step + 1:
                pass
        _, count = HEADER.unpack_from(buf, down + SEQ.size)
        values = rows.unpack_from(buf, down + SEQ.size + HEADER.size)
        tokens = list(zip(values[:count], values[count:2 * count], strict=True))
        assert len(tokens) == batch
        SEQ.pack_into(buf, up, step + 1)
        if not spin:
            os.write(bell_write, b"x")
        times.append(time.perf_counter() - t0)
    del buf
    ring.close()
    return times


# -- the runs ------------------------------------------------------------------------------------

def measure(transport: str, batch: int, rounds: int) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    core: Any
    front: Callable[[], list[float]]
    ring = None
    if transport == "pipe+struct":
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        core = ctx.Process(target=core_pipe, args=(up_r, down_w, batch, rounds))
        front = lambda: front_pipe(down_r, up_w, batch, rounds)  # noqa: E731
    elif transport == "mp.Pipe":
        mine, theirs = ctx.Pipe()
        core = ctx.Process(target=core_mp, args=(theirs, batch, rounds))
        front = lambda: front_mp(mine, batch, rounds)  # noqa: E731
    elif transport in ("shm+doorbell", "shm+spin"):
        spin = transport == "shm+spin"
        ring = shared_memory.SharedMemory(create=True, size=8192)
        assert ring.buf is not None
        ring.buf[:] = bytes(8192)
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        core = ctx.Process(target=core_shm, args=(ring.name, up_r, down_w, batch, rounds, spin))
        front = lambda: front_shm(ring.name, down_r, up_w, batch, rounds, spin)  # noqa: E731
    else:
        raise SystemExit(f"unknown transport {transport}")
    core.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    times = front()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    core.join(30)
    if ring is not None:
        ring.close()
        ring.unlink()
    steady = sorted(times[len(times) // 20:])  # the first 5 % of the rounds warm the path
    return {"transport": transport, "batch": batch, "rounds": rounds,
            "rtt_p50_us": round(1e6 * steady[len(steady) // 2], 1),
            "rtt_p99_us": round(1e6 * steady[int(len(steady) * 0.99)], 1),
            "rtt_mean_us": round(1e6 * wall / rounds, 1),
            "front_cpu_us_per_step": round(1e6 * cpu / rounds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="8,32")
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--transports", default="pipe+struct,mp.Pipe,shm+doorbell,shm+spin")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    args = parser.parse_args(argv)
    results = []
    for transport in args.transports.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            result = measure(transport, batch, args.rounds)
            print(json.dumps(result), flush=True)
            results.append(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpus": os.cpu_count(), "python": sys.version.split()[0], "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
