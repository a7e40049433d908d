"""Which transport moves KV bytes fastest, per placement, each against its raw reference in one run.

For each payload size (4, 64 and 256 MiB by default, and one 2,000-token prefill chunk of the
24 M-parameter llama's KV: hidden 512, 10 layers, 16 KV heads of dim 16, float32, 20,480 bytes per
token, 40,960,000 bytes) this measures, side by side, with the sender and the receiver in separate
processes on 127.0.0.1:

- same host, the bound: `memcpy` (numpy `copyto` into a buffer written before, one process);
- same host, the reference: `shm raw`, the bytes between two processes through shared memory
  with nothing else (`copyto` into a mapped tmpfs file, a line over a pipe, `copyto` out: two
  copies, which any move between processes through shared memory makes);
- `shm` (judged against `shm raw`): `adapters.kv.shm_outbox`, `shm_inbox` end to end (the producer's
  `put` -> the reference over a pipe -> the consumer's `read` -> `copyto` a numpy array: the one copy into
  place -> `done` -> `free`), with and without its CRC-32, and with a fresh outbox per transfer
  (no arena: every region new);
- across hosts, the reference: a raw TCP loopback socket (`sendall` / `recv_into` a buffer
  written before), and tuned variants (`MSG_WAITALL`; the bytes striped over 2 and 4
  connections);
- `http`: the project's KV pull (`adapters.kv.pull.pull` into `ReceiveBuffers`) from a hypercorn
  (trio) + starlette server answering with the node's own body path (`kv_send.kv_body`), and
  (`http tuned`) the same pull from a bare socket server that writes the head and `sendall`s the
  payload's own memory: how much of the gap is the server's body path, and (`http plane`) the same
  pull from the node's KV plane (`adapters.kv.plane`, the body path nodes use beside hypercorn);
- the external engines issue 30 names, each from its own throwaway virtual environment given by
  a flag, and skipped with the reason when it is missing or fails: MLX's `mx.distributed`
  `send`/`recv` on the ring backend (two processes, the ring's environment variables), NIXL with
  UCX (`--nixl-python`; UCX's default transports, which on one host are shared memory, and
  `UCX_TLS=tcp`), Mooncake's transfer engine over TCP (`--mooncake-python`).

Each figure is the median of `--reps` timed transfers after one untimed warm-up, in GB/s (10^9
bytes/s), and as a fraction of its reference measured in the same run at the same size. It prints
a table and writes the rows, the machine and the failures as JSON (`--out`, default
`bench/results/transport_eval.json`).

    .venv/bin/python bench/handoff/transport_eval.py                     # everything found, ~2 min
    .venv/bin/python bench/handoff/transport_eval.py --sizes 4 64 --reps 3 --only memcpy shm tcp
    .venv/bin/python bench/handoff/transport_eval.py --nixl-python /tmp/te/venv-nixl/bin/python \\
        --mooncake-python /tmp/te/venv-mooncake-nc/bin/python

The same file is also the worker each transport's other process runs (`--worker ROLE`); a worker
for an external engine runs under that engine's interpreter, so at its top this file imports only
the standard library and numpy. Bench code: it may import anything, and nothing under src/ may
import it.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
KV_CHUNK_TOKENS = 2000
KV_BYTES_PER_TOKEN = 10 * 2 * 16 * 16 * 4  # layers x (keys, values) x KV heads x head dim x float32
KV_CHUNK_BYTES = KV_CHUNK_TOKENS * KV_BYTES_PER_TOKEN  # 40,960,000
DEADLINE_S = 120.0


def _payload(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Bytes that are not all zeros (no transport may shortcut them), made fast."""
    out = np.empty(nbytes, dtype=np.uint8)
    block = np.random.default_rng(0).integers(0, 256, min(nbytes, MIB), dtype=np.uint8)
    for start in range(0, nbytes, len(block)):
        out[start : start + len(block)] = block[: nbytes - start]
    return out


def _sink(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    out = np.empty(nbytes, dtype=np.uint8)
    out.fill(1)  # every page touched once: a receive buffer kept from an earlier transfer
    return out


# --------------------------------------------------------------------------- talking to workers


class Worker:
    """A child process speaking JSON lines on stdin/stdout; stderr goes to a log file."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> None:
        if log is None:
            handle, name = tempfile.mkstemp(prefix="transport_eval_", suffix=".log")
            os.close(handle)
            log = Path(name)
        self.log = log
        self.role = " ".join(argv[3:5])
        self._err = self.log.open("wb")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._err, env={**os.environ, **(env or {})}, text=True)
        except OSError:
            self._err.close()
            self.log.unlink(missing_ok=True)
            raise

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout_s: float = DEADLINE_S) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            why = self.why()
            self.stop()
            raise RuntimeError(f"worker {self.role} said nothing ({why})")
        document: dict[str, Any] = json.loads(line)
        if "error" in document:
            raise RuntimeError(document["error"])
        return document

    def why(self) -> str:
        self._err.flush()
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit {self.proc.poll()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "exit"})
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._err.close()
        self.log.unlink(missing_ok=True)  # what it said that mattered was read by `why`


def _worker_argv(python: str, role: str, *extra: str) -> list[str]:
    return [python, str(Path(__file__).resolve()), "--worker", role, *extra]


@contextmanager
def _workers(*workers: Worker) -> Iterator[None]:
    try:
        yield
    finally:
        for worker in workers:
            worker.stop()


def _lines() -> Iterator[dict[str, Any]]:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


_REPLIES = sys.stdout  # a worker's private channel to the parent (see `worker_main`)


def _say(**message: Any) -> None:
    print(json.dumps(message), file=_REPLIES, flush=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True, slots=True)
class Row:
    transport: str
    variant: str
    placement: str  # "same host" or "across hosts" (here: loopback)
    reference: str  # the transport whose rate this one is a fraction of
    nbytes: int
    seconds: list[float]
    extra: dict[str, float] | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def gb_s(self) -> float:
        return self.nbytes / 1e9 / self.median_s


def _timed(reps: int, once: Callable[[], float]) -> list[float]:
    once()  # warm up: connections, mappings, pages
    return [once() for _ in range(reps)]


# --------------------------------------------------------------------------- memcpy


def measure_memcpy(nbytes: int, reps: int) -> Row:
    src, dst = _payload(nbytes), _sink(nbytes)

    def once() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    return Row("memcpy", "numpy copyto, warm destination", "same host", "memcpy", nbytes, _timed(reps, once))


# --------------------------------------------------------------------------- shm


def worker_shm_producer(nbytes: int, checksum: bool, fresh: bool) -> None:
    from adapters.kv.shm_outbox import ShmOutbox
    from adapters.kv.shm_region import parse_ref

    src = _payload(nbytes)
    directory = os.environ.get("TRANSPORT_EVAL_SHM_DIR")

    def outbox() -> ShmOutbox:
        return ShmOutbox(max_bytes=max(2 * nbytes, 2 * MIB), directory=directory, checksum=checksum)

    box = outbox()
    _say(ready=True)
    for message in _lines():
        if message["op"] == "put":
            start = time.perf_counter()
            ref = box.put("bench", [src.data])
            _say(ref=ref.model_dump(), put_s=time.perf_counter() - start)
        elif message["op"] == "free":
            box.free(parse_ref(message["ref"]))
            if fresh:
                box.close()
                box = outbox()
            _say(freed=True)
        elif message["op"] == "ping":
            _say(pong=True)
        elif message["op"] == "exit":
            break
    box.close()


def worker_shm_raw_producer(nbytes: int, path: str) -> None:
    """The raw path between two processes through shared memory: `copyto` into a mapped tmpfs
    file the consumer maps too, then one line over the pipe. No framing, no arena, no checks."""
    import mmap

    src = _payload(nbytes)
    with open(path, "r+b") as file, mmap.mmap(file.fileno(), nbytes) as region:
        shared = np.frombuffer(region, dtype=np.uint8)
        _say(ready=True)
        for message in _lines():
            if message["op"] == "put":
                np.copyto(shared, src)
                _say(put=True)
            elif message["op"] == "exit":
                break
        del shared


def measure_shm_raw(nbytes: int, reps: int) -> Row:
    """The same-host reference for `shm`: what any two processes pay to move the bytes through
    shared memory (a copy in, a copy out), against which the project's shared memory is judged;
    `memcpy` (one copy, one process) is the bound neither can reach."""
    import mmap

    directory = os.environ.get("TRANSPORT_EVAL_SHM_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") else None)
    handle, path = tempfile.mkstemp(prefix="transport_eval_raw_", dir=directory)
    try:
        os.ftruncate(handle, nbytes)
        producer = Worker(_worker_argv(sys.executable, "shm-raw-producer", str(nbytes), path))
        dst = _sink(nbytes)
        with _workers(producer), mmap.mmap(handle, nbytes, prot=mmap.PROT_READ) as region:
            producer.receive()

            def once() -> float:
                start = time.perf_counter()
                producer.send({"op": "put"})
                producer.receive()
                np.copyto(dst, np.frombuffer(region, dtype=np.uint8))  # the view goes with the call
                return time.perf_counter() - start

            seconds = _timed(reps, once)
    finally:
        os.close(handle)
        os.unlink(path)
    return Row("shm raw", "two processes: copyto into a mapped tmpfs file, a line over a pipe, copyto out",
               "same host", "memcpy", nbytes, seconds)


def measure_shm(nbytes: int, reps: int, *, checksum: bool, fresh: bool) -> Row:
    from adapters.kv.shm_inbox import ShmInbox
    from adapters.kv.shm_region import parse_ref

    producer = Worker(_worker_argv(sys.executable, "shm-producer", str(nbytes), str(int(checksum)),
                                   str(int(fresh))), env={"PYTHONPATH": str(ROOT / "src")})
    inbox = ShmInbox()
    dst = _sink(nbytes)
    puts: list[float] = []
    consumer: list[float] = []
    with _workers(producer):
        producer.receive()

        def once() -> float:
            start = time.perf_counter()
            producer.send({"op": "put"})
            answer = producer.receive()
            arrived = time.perf_counter()
            ref = parse_ref(answer["ref"])
            view = inbox.read(ref)
            np.copyto(dst, np.frombuffer(view, dtype=np.uint8))  # the one copy into place
            view.release()
            inbox.done(ref)
            end = time.perf_counter()
            producer.send({"op": "free", "ref": answer["ref"]})
            producer.receive()
            puts.append(float(answer["put_s"]))
            consumer.append(end - arrived)
            return end - start

        seconds = _timed(reps, once)
        pings = []
        for _ in range(reps):
            start = time.perf_counter()
            producer.send({"op": "ping"})
            producer.receive()
            pings.append(time.perf_counter() - start)
    inbox.close()
    variant = ("fresh outbox per transfer (no arena)" if fresh else "arena") + (
        ", CRC-32" if checksum else ", no CRC")
    extra = {"put_gb_s": nbytes / 1e9 / statistics.median(puts[1:]),
             "consumer_gb_s": nbytes / 1e9 / statistics.median(consumer[1:]),
             "pipe_rtt_ms": statistics.median(pings) * 1e3}
    return Row("shm", variant, "same host", "shm raw", nbytes, seconds, extra)


# --------------------------------------------------------------------------- raw TCP


def _recv_exact(sock: socket.socket, view: memoryview, waitall: bool) -> None:
    got, size = 0, len(view)
    flags = socket.MSG_WAITALL if waitall else 0
    while got < size:
        n = sock.recv_into(view[got:], size - got, flags)
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        got += n


def _stripes(nbytes: int, n: int) -> list[tuple[int, int]]:
    step = -(-nbytes // n)
    return [(i * step, min(nbytes, (i + 1) * step)) for i in range(n) if i * step < nbytes]


def worker_tcp_sender(nbytes: int, port: int, connections: int) -> None:
    src = _payload(nbytes)
    view = memoryview(src.data).cast("B")
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    stripes = _stripes(nbytes, connections)
    _say(ready=True)
    for message in _lines():
        if message["op"] != "send":
            break
        if connections == 1:
            socks[0].sendall(view)
        else:
            threads = [threading.Thread(target=s.sendall, args=(view[a:b],)) for s, (a, b) in
                       zip(socks, stripes, strict=True)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    for sock in socks:
        sock.close()


def measure_tcp(nbytes: int, reps: int, *, connections: int = 1, waitall: bool = False) -> Row:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sender = Worker(_worker_argv(sys.executable, "tcp-sender", str(nbytes), str(port), str(connections)))
    dst = _sink(nbytes)
    view = memoryview(dst.data).cast("B")
    with _workers(sender), listener:
        socks = [listener.accept()[0] for _ in range(connections)]
        sender.receive()
        stripes = _stripes(nbytes, connections)

        def once() -> float:
            start = time.perf_counter()
            sender.send({"op": "send"})
            if connections == 1:
                _recv_exact(socks[0], view, waitall)
            else:
                threads = [threading.Thread(target=_recv_exact, args=(s, view[a:b], waitall))
                           for s, (a, b) in zip(socks, stripes, strict=True)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            return time.perf_counter() - start

        seconds = _timed(reps, once)
        for sock in socks:
            sock.close()
    if connections == 1 and not waitall:
        return Row("tcp", "raw socket: sendall / recv_into", "across hosts", "tcp", nbytes, seconds)
    variant = f"{connections} connection{'s' if connections > 1 else ''}"
    variant += ", MSG_WAITALL" if waitall else ""
    return Row("tcp tuned", variant, "across hosts", "tcp", nbytes, seconds)


# --------------------------------------------------------------------------- HTTP (the project's pull)


def worker_http_server(nbytes: int) -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from effects.engine_port import KvPieces

    try:
        from adapters.http.kv_send import kv_body, payload_parts  # the node's own body path

        body_path = "adapters.http.kv_send.kv_body"
    except ImportError:  # renamed by a rewrite: serve the bytes in 4 MiB messages as it did
        kv_body = None  # type: ignore[assignment]
        body_path = "starlette StreamingResponse, 4 MiB messages"
    src = _payload(nbytes)

    async def kv(request: Request) -> Response:
        pieces = KvPieces((src.data,))
        if kv_body is not None:
            return kv_body(payload_parts(pieces), pieces.nbytes)
        from starlette.responses import StreamingResponse

        async def chunks() -> Any:
            for start in range(0, nbytes, 4 * MIB):
                yield bytes(src.data[start : start + 4 * MIB])

        return StreamingResponse(chunks(), headers={"content-length": str(nbytes)})

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]  # as adapters.serve.node.hypercorn_config
    config.accesslog = None
    _say(port=port, body_path=body_path)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            app = Starlette(routes=[Route("/kv", kv)])
            nursery.start_soon(serve, app, config)  # type: ignore[arg-type]
            await trio.to_thread.run_sync(sys.stdin.readline)  # "exit"
            nursery.cancel_scope.cancel()

    trio.run(main)


def worker_http_bare_server(nbytes: int) -> None:
    """The body path without hypercorn and starlette: read a request head, answer with a
    Content-Length head and `sendall` the payload's own memory (no slices joined, no copy in
    Python). What the pull could reach if KV bodies were served beside the ASGI app."""
    src = _payload(nbytes)
    view = memoryview(src.data).cast("B")
    listener = socket.create_server(("127.0.0.1", 0))
    head = (f"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {nbytes}"
            "\r\nconnection: close\r\n\r\n").encode()

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                conn.sendall(head)
                conn.sendall(view)

    threading.Thread(target=serve, daemon=True).start()
    _say(port=listener.getsockname()[1], body_path="a bare socket server: head, then sendall of the payload")
    sys.stdin.readline()  # "exit"


def worker_http_plane_server(nbytes: int) -> None:
    """The node's KV plane (`adapters.kv.plane`) answering with the node's own body parts
    (`kv_send.payload_parts`: the payload's memory as it is, then its end frame)."""
    import trio

    from adapters.http.kv_send import payload_parts
    from adapters.kv.plane import PlaneAnswer, PlaneRequest, serve_plane
    from effects.engine_port import KvPieces

    src = _payload(nbytes)

    async def handler(request: PlaneRequest) -> PlaneAnswer:
        return PlaneAnswer(200, payload_parts(KvPieces((src.data,))), nbytes)

    async def main() -> None:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_plane, listener, handler, 1 << 20)
            _say(port=listener.socket.getsockname()[1], body_path="the node's KV plane (adapters.kv.plane)")
            await trio.to_thread.run_sync(sys.stdin.readline)  # "exit"
            nursery.cancel_scope.cancel()

    trio.run(main)


def measure_http(nbytes: int, reps: int, *, bare: bool = False, plane: bool = False) -> Row:
    import trio

    from adapters.kv.pull import ReceiveBuffers, pull

    role = "http-plane-server" if plane else "http-bare-server" if bare else "http-server"
    server = Worker(_worker_argv(sys.executable, role, str(nbytes)),
                    env={"PYTHONPATH": str(ROOT / "src")})
    buffers = ReceiveBuffers(keep_bytes=2 * nbytes)
    with _workers(server):
        hello = server.receive()
        url = f"http://127.0.0.1:{hello['port']}/kv"

        body_seconds: list[float] = []

        async def one() -> float:
            start = time.perf_counter()
            pulled = await pull(url, [], max_bytes=2 * nbytes, connect_timeout_s=30, buffers=buffers)
            end = time.perf_counter()
            if pulled.status != 200 or len(pulled.body) != nbytes:
                raise RuntimeError(f"pull answered {pulled.status} with {len(pulled.body)} bytes")
            body_seconds.append(pulled.last_byte_s - pulled.head_s)
            return end - start

        async def run() -> list[float]:
            await one()
            body_seconds.clear()
            return [await one() for _ in range(reps)]

        seconds = trio.run(run)
    variant = f"KV pull (h11 head, recv_into body) from {hello['body_path']}"
    # The body alone (head parsed -> last byte): the rate a stream's records move at, where no
    # request, connection or head comes per piece (a streamed handoff's pieces)
    extra = {"body_gb_s": round(nbytes / 1e9 / statistics.median(body_seconds), 2),
             "request_ms": round(1e3 * (statistics.median(seconds) - statistics.median(body_seconds)), 2)}
    return Row("http plane" if plane else "http tuned" if bare else "http", variant, "across hosts", "tcp",
               nbytes, seconds, extra)


# --------------------------------------------------------------------------- mx.distributed (ring)


def worker_mlx_ring(nbytes: int, reps: int) -> None:
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="ring")
    rank = group.rank()
    src = mx.array(_payload(nbytes)) if rank == 0 else None
    seconds: list[float] = []
    for _ in range(reps + 1):
        mx.eval(mx.distributed.all_sum(mx.array(1.0)))  # both ranks here before the clock starts
        start = time.perf_counter()
        if rank == 0:
            assert src is not None
            mx.eval(mx.distributed.send(src, 1))
        else:
            got = mx.distributed.recv((nbytes,), mx.uint8, 0)
            mx.eval(got)
        seconds.append(time.perf_counter() - start)
    if rank == 1:
        _say(seconds=seconds[1:], crc=zlib.crc32(np.array(got).data))
    else:
        _say(sent=True, crc=zlib.crc32(_payload(nbytes).data))


def measure_mlx_ring(nbytes: int, reps: int, python: str) -> Row:
    handle, name = tempfile.mkstemp(prefix="transport_eval_ring_", suffix=".json")
    os.close(handle)
    hostfile = Path(name)
    hostfile.write_text(json.dumps([[f"127.0.0.1:{_free_port()}"], [f"127.0.0.1:{_free_port()}"]]))
    ranks = [Worker(_worker_argv(python, "mlx-ring", str(nbytes), str(reps)),
                    env={"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}) for rank in (0, 1)]
    try:
        with _workers(*ranks):
            sent = ranks[0].receive(timeout_s=DEADLINE_S * 3)
            got = ranks[1].receive(timeout_s=DEADLINE_S * 3)
    finally:
        hostfile.unlink()
    if sent["crc"] != got["crc"]:
        raise RuntimeError("mx.distributed delivered other bytes than it was given")
    return Row("mx.distributed", "ring backend, send/recv, 127.0.0.1", "across hosts", "tcp", nbytes,
               got["seconds"])


# --------------------------------------------------------------------------- NIXL (UCX)


def worker_nixl(role: str, nbytes: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[import-not-found]

    agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    buffer = _payload(nbytes) if role == "initiator" else _sink(nbytes)
    addr = buffer.ctypes.data
    agent.register_memory([(addr, nbytes, 0, "")], "DRAM")
    if role == "target":
        _say(meta=base64.b64encode(agent.get_agent_metadata()).decode(), addr=addr)
        for message in _lines():
            if message["op"] == "crc":
                _say(crc=zlib.crc32(buffer.data))
            else:
                break
        return
    handle = None
    for message in _lines():
        if message["op"] == "connect":
            remote = agent.add_remote_agent(base64.b64decode(message["meta"]))
            local = agent.get_xfer_descs([(addr, nbytes, 0)], "DRAM")
            far = agent.get_xfer_descs([(int(message["addr"]), nbytes, 0)], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, far, remote, b"kv")
            _say(connected=True, crc=zlib.crc32(buffer.data))
        elif message["op"] == "send":
            assert handle is not None
            start = time.perf_counter()
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended {state}")
            _say(seconds=time.perf_counter() - start)
        else:
            break


def measure_nixl(nbytes: int, reps: int, python: str, tls: str | None) -> Row:
    env = {"UCX_NET_DEVICES": "lo"}  # never any interface but the loopback
    if tls:
        env["UCX_TLS"] = tls
    target = Worker(_worker_argv(python, "nixl", "target", str(nbytes)), env=env)
    initiator = Worker(_worker_argv(python, "nixl", "initiator", str(nbytes)), env=env)
    with _workers(initiator, target):
        hello = target.receive()
        initiator.send({"op": "connect", **hello})
        sent = initiator.receive()

        def once() -> float:
            initiator.send({"op": "send"})
            return float(initiator.receive()["seconds"])

        seconds = _timed(reps, once)
        target.send({"op": "crc"})
        if target.receive()["crc"] != sent["crc"]:
            raise RuntimeError("NIXL delivered other bytes than it was given")
    if tls:
        return Row("nixl", f"UCX, UCX_TLS={tls}, WRITE", "across hosts", "tcp", nbytes, seconds)
    return Row("nixl", "UCX default transports (one host: shared memory), WRITE", "same host", "memcpy",
               nbytes, seconds)


# --------------------------------------------------------------------------- Mooncake


def worker_mooncake(role: str, nbytes: int) -> None:
    from mooncake.engine import TransferEngine  # type: ignore[import-not-found]

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("mooncake TransferEngine.initialize failed")
    buffer = _payload(nbytes) if role == "initiator" else _sink(nbytes)
    addr = buffer.ctypes.data
    if engine.register_memory(addr, nbytes) != 0:
        raise RuntimeError("mooncake register_memory failed")
    if role == "target":
        _say(session=f"127.0.0.1:{engine.get_rpc_port()}", addr=addr)
        for message in _lines():
            if message["op"] == "crc":
                _say(crc=zlib.crc32(buffer.data))
            else:
                break
        return
    session, far = "", 0
    for message in _lines():
        if message["op"] == "connect":
            session, far = message["session"], int(message["addr"])
            _say(connected=True, crc=zlib.crc32(buffer.data))
        elif message["op"] == "send":
            start = time.perf_counter()
            if engine.transfer_sync_write(session, addr, far, nbytes) != 0:
                raise RuntimeError("mooncake transfer_sync_write failed")
            _say(seconds=time.perf_counter() - start)
        else:
            break


def measure_mooncake(nbytes: int, reps: int, python: str) -> Row:
    target = Worker(_worker_argv(python, "mooncake", "target", str(nbytes)))
    initiator = Worker(_worker_argv(python, "mooncake", "initiator", str(nbytes)))
    with _workers(initiator, target):
        hello = target.receive()
        initiator.send({"op": "connect", **hello})
        sent = initiator.receive()

        def once() -> float:
            initiator.send({"op": "send"})
            return float(initiator.receive()["seconds"])

        seconds = _timed(reps, once)
        target.send({"op": "crc"})
        if target.receive()["crc"] != sent["crc"]:
            raise RuntimeError("Mooncake delivered other bytes than it was given")
    return Row("mooncake", "transfer engine, tcp protocol, sync WRITE", "across hosts", "tcp", nbytes,
               seconds)


# --------------------------------------------------------------------------- the run


def _guard_worker(run: Callable[[], None]) -> int:
    try:
        run()
    except Exception as exc:  # reported to the parent as the failure's line
        _say(error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def worker_main(argv: list[str]) -> int:
    global _REPLIES
    # replies go to a copy of stdout; what the engines' libraries print there goes to stderr
    _REPLIES = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    role, *rest = argv
    if role == "shm-producer":
        sys.path.insert(0, str(ROOT / "src"))
        return _guard_worker(lambda: worker_shm_producer(int(rest[0]), rest[1] == "1", rest[2] == "1"))
    if role == "shm-raw-producer":
        return _guard_worker(lambda: worker_shm_raw_producer(int(rest[0]), rest[1]))
    if role == "tcp-sender":
        return _guard_worker(lambda: worker_tcp_sender(int(rest[0]), int(rest[1]), int(rest[2])))
    if role == "http-server":
        sys.path.insert(0, str(ROOT / "src"))
        return _guard_worker(lambda: worker_http_server(int(rest[0])))
    if role == "http-plane-server":
        sys.path.insert(0, str(ROOT / "src"))
        return _guard_worker(lambda: worker_http_plane_server(int(rest[0])))
    if role == "http-bare-server":
        return _guard_worker(lambda: worker_http_bare_server(int(rest[0])))
    if role == "mlx-ring":
        return _guard_worker(lambda: worker_mlx_ring(int(rest[0]), int(rest[1])))
    if role == "nixl":
        return _guard_worker(lambda: worker_nixl(rest[0], int(rest[1])))
    if role == "mooncake":
        return _guard_worker(lambda: worker_mooncake(rest[0], int(rest[1])))
    raise SystemExit(f"unknown worker role {role!r}")


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "loadavg_start": os.getloadavg(), "shared": "2 cores shared with other agents' work",
    }


def size_label(nbytes: int) -> str:
    if nbytes == KV_CHUNK_BYTES:
        return f"KV chunk {KV_CHUNK_TOKENS} tok ({nbytes / 1e6:.2f} MB)"
    return f"{nbytes // MIB} MiB" if nbytes % MIB == 0 else f"{nbytes:,} B"


def key(row: Row) -> tuple[str, str, int]:
    return row.transport, row.variant, row.nbytes


def merge(rounds: list[list[Row]]) -> list[Row]:
    """One row per (transport, variant, size): every round's timed transfers together; the
    notes (per-side rates) are the median of the rounds' figures."""
    grouped: dict[tuple[str, str, int], list[Row]] = {}
    for row in (r for rows in rounds for r in rows):
        grouped.setdefault(key(row), []).append(row)
    merged = []
    for same in grouped.values():
        first = same[0]
        extra = None
        if first.extra:
            extra = {k: statistics.median((r.extra or {})[k] for r in same) for k in first.extra}
        merged.append(Row(first.transport, first.variant, first.placement, first.reference, first.nbytes,
                          [s for r in same for s in r.seconds], extra))
    return merged


def spread(rounds: list[list[Row]], row: Row) -> list[float]:
    """This row's fraction of its reference in each round (the reference measured in that round)."""
    out = []
    for rows in rounds:
        mine = next((r for r in rows if key(r) == key(row)), None)
        ref = next((r for r in rows if r.transport == row.reference and r.nbytes == row.nbytes), None)
        if mine is not None and ref is not None:
            out.append(mine.gb_s / ref.gb_s)
    return out


def table(rows: list[Row], references: dict[tuple[str, int], float],
          spreads: dict[tuple[str, str, int], list[float]]) -> str:
    lines = ["| transport | variant | placement | size | median ms | GB/s | reference | of reference "
             "| per round | notes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = references.get((r.reference, r.nbytes))
        share = f"{r.gb_s / ref:.2f}" if ref else "-"
        per_round = spreads.get(key(r), [])
        span = f"{min(per_round):.2f}-{max(per_round):.2f}" if len(per_round) > 1 else "-"
        notes = ", ".join(f"{k} {v:.2f}" for k, v in (r.extra or {}).items())
        lines.append(f"| {r.transport} | {r.variant} | {r.placement} | {size_label(r.nbytes)} "
                     f"| {r.median_s * 1e3:.1f} | {r.gb_s:.2f} | {r.reference} | {share} | {span} "
                     f"| {notes} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--worker"]:
        return worker_main(args_list[1:])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 64, 256], help="MiB")
    parser.add_argument("--no-kv-chunk", action="store_true", help="skip the 2,000-token KV chunk")
    parser.add_argument("--reps", type=int, default=5, help="timed transfers per measurement")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds over everything")
    parser.add_argument("--only", nargs="+", help="transports to run (memcpy shm tcp http mlx nixl mooncake)")
    parser.add_argument("--mlx-python", default=sys.executable, help="an interpreter with mlx (this one)")
    parser.add_argument("--nixl-python", help="an interpreter with `pip install nixl` (a throwaway venv)")
    parser.add_argument("--mooncake-python",
                        help="an interpreter with mooncake-transfer-engine(-non-cuda) (a throwaway venv)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "transport_eval.json")
    args = parser.parse_args(args_list)
    sys.path.insert(0, str(ROOT / "src"))

    sizes = [s * MIB for s in args.sizes]
    if not args.no_kv_chunk:
        sizes.insert(1 if sizes else 0, KV_CHUNK_BYTES)
    only = set(args.only or ["memcpy", "shm", "tcp", "http", "mlx", "nixl", "mooncake"])
    started = dt.datetime.now(dt.UTC)
    host = machine()
    print(f"# transport_eval {started:%Y-%m-%d %H:%M} UTC; {host['platform']}, {host['cpus']} CPUs, "
          f"load {host['loadavg_start'][0]:.1f} ({host['shared']}); median of {args.reps} after a warm-up, "
          f"x {args.rounds} rounds",
          flush=True)

    plan: list[tuple[str, Callable[[int], Row]]] = []
    if "memcpy" in only:
        plan.append(("memcpy", lambda n: measure_memcpy(n, args.reps)))
    if "shm" in only:
        plan += [("shm raw", lambda n: measure_shm_raw(n, args.reps)),
                 ("shm", lambda n: measure_shm(n, args.reps, checksum=False, fresh=False)),
                 ("shm", lambda n: measure_shm(n, args.reps, checksum=True, fresh=False)),
                 ("shm", lambda n: measure_shm(n, args.reps, checksum=False, fresh=True))]
    if "tcp" in only:
        plan += [("tcp", lambda n: measure_tcp(n, args.reps)),
                 ("tcp", lambda n: measure_tcp(n, args.reps, waitall=True)),
                 ("tcp", lambda n: measure_tcp(n, args.reps, connections=2)),
                 ("tcp", lambda n: measure_tcp(n, args.reps, connections=4))]
    if "http" in only:
        plan += [("http", lambda n: measure_http(n, args.reps)),
                 ("http tuned", lambda n: measure_http(n, args.reps, bare=True)),
                 ("http plane", lambda n: measure_http(n, args.reps, plane=True))]
    if "mlx" in only:
        plan.append(("mx.distributed", lambda n: measure_mlx_ring(n, args.reps, args.mlx_python)))
    failures: dict[str, str] = {}
    if "nixl" in only:
        if args.nixl_python:
            nixl = args.nixl_python
            plan += [("nixl", lambda n: measure_nixl(n, args.reps, nixl, None)),
                     ("nixl tcp", lambda n: measure_nixl(n, args.reps, nixl, "tcp"))]
        else:
            failures["nixl"] = "not run: no --nixl-python"
    if "mooncake" in only:
        if args.mooncake_python:
            mooncake = args.mooncake_python
            plan.append(("mooncake", lambda n: measure_mooncake(n, args.reps, mooncake)))
        else:
            failures["mooncake"] = "not run: no --mooncake-python"

    rounds: list[list[Row]] = []
    for round_index in range(args.rounds):  # rounds alternate, so a burst of load hits all alike
        rows: list[Row] = []
        for nbytes in sizes:
            for name, measure in plan:
                if name in failures:
                    continue
                try:
                    row = measure(nbytes)
                except Exception as exc:  # an engine that does not run here: recorded, the rest goes on
                    failures[name] = f"{type(exc).__name__}: {exc}"
                    print(f"  {name}: FAILED: {failures[name]}", file=sys.stderr, flush=True)
                    continue
                rows.append(row)
                print(f"  round {round_index + 1}, {size_label(nbytes)}: {row.transport} ({row.variant}): "
                      f"{row.gb_s:.2f} GB/s", file=sys.stderr, flush=True)
        rounds.append(rows)

    merged = merge(rounds)
    references = {(r.transport, r.nbytes): r.gb_s for r in merged
                  if r.transport in ("memcpy", "shm raw", "tcp")}
    spreads = {key(r): spread(rounds, r) for r in merged}
    print(table(merged, references, spreads))
    for name, why in failures.items():
        print(f"- {name}: {why}")
    host["loadavg_end"] = os.getloadavg()
    report = {
        "date": started.isoformat(), "machine": host, "argv": sys.argv, "reps": args.reps,
        "rounds": args.rounds,
        "kv_chunk": {"tokens": KV_CHUNK_TOKENS, "bytes_per_token": KV_BYTES_PER_TOKEN,
                     "bytes": KV_CHUNK_BYTES,
                     "model": "llama, 24 M parameters: hidden 512, 10 layers, 16 KV heads x 16, float32"},
        "rows": [{**asdict(r), "median_s": r.median_s, "gb_s": r.gb_s,
                  "of_reference": (r.gb_s / references[(r.reference, r.nbytes)]
                                   if (r.reference, r.nbytes) in references else None),
                  "of_reference_per_round": spreads[key(r)]} for r in merged],
        "failures": failures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
