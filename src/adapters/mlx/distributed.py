"""Tensor-parallel instances on MLX's own distributed runtime: the ranks' lockstep device loop.

An instance of N ranks loads one shard of the model per rank (mlx-lm's `model.shard`); every model
call then runs collectives across the ranks, so every rank must make the same calls in the same
order. `LockstepLoop` is the device loop of each rank. On rank 0 (the node: HTTP, scheduler) it
takes the jobs that arrived, broadcasts their replicated commands (`adapters.mlx.lockstep.Plan`,
bytes in a uint8 array summed over `mx.distributed`) and only then performs them and runs the
step; on the other ranks it receives each plan, performs the very same commands (the same
`perform` as rank 0's, without rank 0's local attachments) and runs the same step with its own
shard, its tokens going nowhere. Idle, rank 0 broadcasts
an empty plan every `heartbeat_s`, so a lost rank shows within a heartbeat and a waiting rank
knows rank 0 is alive. MLX's collectives have no timeout: a rank that dies makes the others'
collective raise ("connection to a peer was lost": the device thread dies, the node exits), one
that stalls makes them wait, which the node's stall watchdog (--stall-timeout) and
`watch_follower` turn into an exit. The plan travels on the model's stream, so it is ordered
after the previous step's collectives; the price is that building a step no longer overlaps the
previous step's computation. An export carries every head: `gather_heads` collects a held cache's
heads on rank 0. An install reaches each rank as its own heads only: rank 0 pulls the payload,
keeps its heads (`own_heads`) and passes the other ranks' slices, each a payload of its own head
range, point to point down the ranks (`pass_on_slices`, `receive_slice`).
A pipeline-parallel instance (`TensorGroup.pipeline`) runs the same lockstep: each rank holds
its share of the layers (mlx-lm's `model.model.pipeline`: rank 0 the last ones) and the model
call itself passes the activations from rank to rank (send/recv) and hands the last rank's output
to all (all_gather); `agree_max` makes the decisions that depend on a rank's layers (KV bytes per
token) the same on every rank. Its caches do not travel (`refuse_pipelined_handoff`).
`start_local_ranks` starts ranks 1..N-1 of an instance on this machine over the ring backend
(what `mlx.launch` does, without ssh). This module imports mlx; it must never import trio.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import KVCache

from adapters.mlx import commands, lockstep
from adapters.mlx.device import DeviceLoop, InjectedCrash
from adapters.mlx.jobs import Crash, Job, Stop
from adapters.mlx.settings import Settings
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error

__all__ = [
    "BACKENDS", "PARENT_ENV", "RANK_ENV", "DivergedRanks", "LockstepLoop", "TensorGroup", "agree_max",
    "every_rank",
    "exited_rank", "join_group", "rank_heads", "refuse_pipelined_handoff", "start_local_ranks",
    "watch_follower",
]

logger = logging.getLogger("adapters.engine_mlx")

BACKENDS = ("ring", "nccl", "jaccl", "mpi", "any")
RANK_ENV = "MLX_RANK"
HOSTFILE_ENV = "MLX_HOSTFILE"
PARENT_ENV = "STATECORE_TP_PARENT"  # a locally started rank's rank 0 (it leaves when that pid is gone)
EXIT_RANK_LOST = 3  # as a node whose engine is lost: its supervisor restarts the instance


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """This process's place in a tensor-parallel instance."""

    group: Any  # mx.distributed.Group
    rank: int
    size: int
    heartbeat_s: float  # rank 0 broadcasts at least this often, idle or not
    # Rank 0 of locally started ranks: which one exited (None: all run). A dead rank is seen at
    # once even when a collective in flight never fails.
    rank_lost: Callable[[], str | None] = lambda: None
    pipeline: bool = False  # each rank holds a share of the layers (not of the heads)


def agree_max(group: Any, values: Sequence[int]) -> list[int]:
    """Every rank's `values`, element by element the largest over the ranks (a collective: every
    rank calls it at the same point)."""
    with mx.stream(generation_stream):
        top = mx.distributed.all_max(mx.array(list(values), dtype=mx.int64), group=group)
        mx.eval(top)
    return [int(v) for v in top.tolist()]  # type: ignore[union-attr,arg-type]


def every_rank(group: Any, value: int) -> list[int]:
    """Each rank's `value`, in rank order (a collective: every rank calls it at the same point)."""
    with mx.stream(generation_stream):
        gathered = mx.distributed.all_gather(mx.array([value], dtype=mx.int64), group=group)
        mx.eval(gathered)
    return [int(v) for v in gathered.tolist()]  # type: ignore[union-attr,arg-type]


def refuse_pipelined_handoff(what: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(
        Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE,
        f"a pipeline-parallel instance cannot {what}: each of its ranks holds the caches of its own "
        "layers only, and the KV wire carries a whole model's layers (use --tensor-parallel, or a "
        "single node, for a prefill or decode node that hands off)"))


def join_group(backend: str, size: int, heartbeat_s: float,
               rank_lost: Callable[[], str | None] = lambda: None) -> TensorGroup:
    """Join the instance's group (the environment mlx.launch or `start_local_ranks` set)."""
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as exc:
        raise StatecoreError(ErrorInfo(
            Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
            f"cannot join the {backend} group of --tensor-parallel {size}: {type(exc).__name__}: {exc}",
        )) from exc
    if group.size() != size:
        raise StatecoreError(client_error(
            f"--tensor-parallel {size}, but MLX's {backend} group has {group.size()} ranks"))
    return TensorGroup(group, group.rank(), size, heartbeat_s, rank_lost)


def start_local_ranks(size: int, argv: Sequence[str]) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..size-1 of an instance on 127.0.0.1 (ring backend), running `argv` with MLX's ring
    environment; this process becomes rank 0 (its environment is set too)."""
    ports = []
    for _ in range(size):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    handle, hostfile = tempfile.mkstemp(prefix="statecore-ring-", suffix=".json")
    with os.fdopen(handle, "w") as out:
        json.dump([[f"127.0.0.1:{port}"] for port in ports], out)
    children = []
    for rank in range(1, size):
        env = {**os.environ, RANK_ENV: str(rank), HOSTFILE_ENV: hostfile, PARENT_ENV: str(os.getpid())}
        children.append(subprocess.Popen([sys.executable, *argv], env=env))
        logger.info("started tensor-parallel rank %d of %d (pid %d)", rank, size, children[-1].pid)
    os.environ[RANK_ENV] = "0"
    os.environ[HOSTFILE_ENV] = hostfile
    return children


def rank_heads(rank: int, size: int, heads: int) -> tuple[int, int]:
    """KV heads [start, stop) of `rank` among `size` (mlx-lm's `model.shard` splits heads in
    contiguous equal ranges); KV_MALFORMED when `heads` does not split."""
    if heads <= 0 or heads % size:
        raise StatecoreError(ErrorInfo(
            Fault.PEER, Code.KV_MALFORMED, f"a handoff of {heads} KV heads does not split over {size} ranks"))
    return rank * heads // size, (rank + 1) * heads // size


def exited_rank(children: Sequence[subprocess.Popen[bytes]]) -> str | None:
    """The first locally started rank that has exited, in words (None: all run)."""
    for rank, child in enumerate(children, start=1):
        code = child.poll()
        if code is not None:
            return f"tensor-parallel rank {rank} (pid {child.pid}) exited with {code}"
    return None


def watch_follower(loop: LockstepLoop, thread: threading.Thread, stall_timeout_s: float,
                   parent: int | None) -> int:
    """A rank > 0's main thread: the exit code once its device thread ends, rank 0 has been silent
    for `stall_timeout_s` (> 0), or the local launcher (`parent`) is gone."""
    while thread.is_alive():
        thread.join(0.2)
        silent = time.monotonic() - loop.inbox.progress_at
        if stall_timeout_s > 0 and silent > stall_timeout_s and not loop.loading:
            logger.error("rank %d: no plan from rank 0 for %.1f s (--stall-timeout %g): exiting %d",
                         loop.tensor.rank, silent, stall_timeout_s, EXIT_RANK_LOST)
            return EXIT_RANK_LOST
        if parent is not None and os.getppid() != parent:
            logger.error("rank %d: rank 0 (pid %d) is gone: exiting %d", loop.tensor.rank, parent,
                         EXIT_RANK_LOST)
            return EXIT_RANK_LOST
    return 0 if loop.stopped else EXIT_RANK_LOST


class DivergedRanks(RuntimeError):
    """A rank holds other requests than rank 0 (a bug): the instance must restart."""


class LockstepLoop(DeviceLoop):
    """The device loop of one rank of a tensor-parallel instance (see the module's paragraph)."""

    def __init__(self, settings: Settings, queue_: queue.SimpleQueue[Job[Any] | Stop | Crash],
                 tensor: TensorGroup) -> None:
        super().__init__(settings, queue_)
        self.inbox.undo_in_order = True  # a job abandoned after its plan went is undone in a later one
        self.tensor = tensor
        self.plans = 0  # plans broadcast (rank 0) or received (the others)
        self.stopped = False  # left the loop on rank 0's Stop
        self.loading = False  # replaying the load, as long as it takes (silence is not a stall)
        self.leader_state: tuple[int, ...] = ()  # rank 0's state_digest with the last plan

    def run(self) -> None:
        if self.tensor.rank == 0:
            self.lead()
        else:
            self.follow()

    def lead(self) -> None:
        while True:
            # Idle, an empty plan goes out every heartbeat.
            jobs = self.inbox.take(wait=not (self.live or self.waiting or self.inflight),
                                  timeout=self.tensor.heartbeat_s)
            taken: list[Job[Any]] = []
            replicated: list[commands.Replicated] = []
            stop = False
            for job in jobs:
                if isinstance(job, Stop):
                    stop = True
                    replicated.append(commands.Stop())
                    break
                if isinstance(job, Crash):
                    raise InjectedCrash("device loop crash injected by a test")
                # Decided here for every rank: a job abandoned after this point still runs
                # (its undo then travels in a later plan: `Inbox.undo_in_order`).
                if job.is_abandoned():
                    continue
                taken.append(job)
                if isinstance(job.command, commands.REPLICATED):
                    replicated.append(job.command)
            self.broadcast(lockstep.encode_plan(lockstep.Plan(tuple(replicated))))
            self.inbox.progress_at = time.monotonic()
            for job in taken:
                self.compute_job(job)
                self.inbox.progress_at = time.monotonic()
            if stop:
                self.stopped = True
                return
            self.executor.step()
            self.inbox.progress_at = time.monotonic()

    def follow(self) -> None:
        while True:
            plan = lockstep.decode_plan(self.broadcast(None))
            self.inbox.progress_at = time.monotonic()
            if self.leader_state != self.state_digest():
                raise DivergedRanks(
                    f"rank {self.tensor.rank} holds (live, waiting, held, arrivals) "
                    f"{self.state_digest()}, rank 0 {self.leader_state}: the ranks' model calls no "
                    "longer match")
            for command in plan.commands:
                if isinstance(command, commands.Stop):
                    self.stopped = True
                    return
                self.loading = isinstance(command, commands.Load)
                self.compute_job(Job(command, None))
                self.loading = False
                self.inbox.progress_at = time.monotonic()
            self.executor.step()
            self.inbox.progress_at = time.monotonic()

    def drop_abandoned_waiting(self) -> None:
        """Not here: the caller's exit queues a Drop, which every rank applies in one plan."""

    # -- collectives ---------------------------------------------------------------------------

    def state_digest(self) -> tuple[int, ...]:
        """What every rank must hold alike between two plans (a cheap check that they still do)."""
        return (len(self.live), len(self.waiting), len(self.held), self.arrivals % (1 << 31))

    def broadcast(self, data: bytes | None) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): its length and rank 0's
        `state_digest` (kept in `leader_state`), then the bytes, each summed with zeros from the
        other ranks. On the model's stream: ordered after the collectives of the step before."""
        group = self.tensor.group
        head = [len(data), *self.state_digest()] if data is not None else [0] * 5
        with mx.stream(generation_stream):
            summed_head = mx.distributed.all_sum(mx.array(head, dtype=mx.int32), group=group)
            size, *leader_state = (int(v) for v in summed_head.tolist())  # type: ignore[union-attr,arg-type]
            self.leader_state = tuple(leader_state)
            self.plans += 1
            if size == 0:
                return b""
            mine = (mx.zeros((size,), dtype=mx.uint8) if data is None
                    else mx.array(np.frombuffer(data, dtype=np.uint8)))
            summed = mx.distributed.all_sum(mine, group=group)
            mx.eval(summed)
        return bytes(np.array(summed))

    def gather_heads(self, cache: list[Any]) -> list[Any]:
        """A held cache with every rank's heads (each rank calls it in the same plan)."""
        if self.tensor.size == 1:
            return cache
        _plain_layers_only(cache, "hands off")
        gathered = []
        with mx.stream(generation_stream):
            for layer in cache:
                keys, values = layer.keys_and_values()  # (its buffers run past its length)
                full = KVCache()  # type: ignore[no-untyped-call]
                full.state = (self.gather_axis1(keys), self.gather_axis1(values), layer.offset)
                gathered.append(full)
            mx.eval([layer.keys for layer in gathered], [layer.values for layer in gathered])
        return gathered

    def gather_axis1(self, x: Any) -> Any:
        together = mx.distributed.all_gather(mx.moveaxis(x, 1, 0), group=self.tensor.group)
        return mx.moveaxis(together, 0, 1)

    def head_ranges(self, cache: list[Any]) -> list[tuple[int, int]]:
        """Each rank's KV heads (start, stop) of a cache that holds them all; raises the typed
        error of a cache that cannot be split (rank 0 asks before any rank waits for a slice)."""
        ranges: set[tuple[tuple[int, int], ...]] = set()
        _plain_layers_only(cache, "installs")
        for layer in cache:
            heads = int(layer.keys.shape[1]) if layer.keys is not None else 0
            ranges.add(tuple(rank_heads(rank, self.tensor.size, heads) for rank in range(self.tensor.size)))
        if len(ranges) != 1:
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED, "a handoff whose layers hold different numbers of KV heads"))
        return list(ranges.pop())

    def pass_on_slices(self, slices: Sequence[Sequence[bytes | memoryview]]) -> None:
        """Rank 0: ranks 1..N-1's payloads (`slices[r - 1]`, each as the byte pieces it is made
        of) down the chain of ranks, each of which keeps its own and passes on the rest
        (`receive_slice`): MLX's ring backend reaches only a rank's neighbours. Every rank
        receives its own bytes and the later ranks' only. The pieces are copied once, into the
        buffer that is sent."""
        sizes = [sum(len(piece) for piece in pieces) for pieces in slices]
        joined = np.empty(sum(sizes), dtype=np.uint8)
        at = 0
        for pieces in slices:
            for piece in pieces:
                joined[at:at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
                at += len(piece)
        self._send_on(mx.array(sizes, dtype=mx.int64), mx.array(joined))

    def receive_slice(self) -> memoryview:
        """A rank > 0: its own payload from `pass_on_slices` (the later ranks' it passes on), a
        view of the received array's memory."""
        rank, group = self.tensor.rank, self.tensor.group
        with mx.stream(generation_stream):
            lengths = mx.distributed.recv((self.tensor.size - rank,), mx.int64, rank - 1, group=group)
            sizes = [int(v) for v in lengths.tolist()]  # type: ignore[union-attr,arg-type]
            data = mx.distributed.recv((sum(sizes),), mx.uint8, rank - 1, group=group)
            mx.eval(data)
        if rank + 1 < self.tensor.size:
            self._send_on(lengths[1:], data[sizes[0]:])
        mine: memoryview = np.asarray(data)[:sizes[0]].data
        return mine

    def _send_on(self, lengths: Any, data: Any) -> None:
        group, to = self.tensor.group, self.tensor.rank + 1
        with mx.stream(generation_stream):
            mx.eval(mx.distributed.send(lengths, to, group=group))
            mx.eval(mx.distributed.send(data, to, group=group))

    def own_heads(self, cache: list[Any]) -> list[Any]:
        """This rank's heads of a cache that holds them all (rank 0's copy of an installed handoff)."""
        if self.tensor.size == 1:
            return cache
        start, stop = self.head_ranges(cache)[self.tensor.rank]
        mine = []
        for layer in cache:
            keys, values = layer.keys_and_values()
            part = slice(start, stop)
            own = KVCache()  # type: ignore[no-untyped-call]
            own.state = (mx.contiguous(keys[:, part]), mx.contiguous(values[:, part]), layer.offset)
            mine.append(own)
        mx.eval([layer.keys for layer in mine], [layer.values for layer in mine])
        return mine


def _plain_layers_only(cache: list[Any], doing: str) -> None:
    """A tensor-parallel instance splits plain KVCache layers by head, and no other kind."""
    for layer in cache:
        if type(layer) is not KVCache:
            raise StatecoreError(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE,
                f"a tensor-parallel instance {doing} plain KVCache layers only, not {type(layer).__name__}"))
