"""What an engine-backed node says about itself, and whether it takes a request now.

`GET /health` (ok, or 503 with why: its engine lost, its loop not accepting), `GET /internal/info`
(the model's fingerprint and per-layer cache travel report, the BLAS, how it takes a streamed
handoff), `GET /internal/stats` (live counts for leak checks), `GET /internal/handoffs` (the recent
KV handoffs' bytes and timings). Its engine lost, a node refuses every new request as a failed
peer (`NodeStatus.admit`) until its loop ends and it exits. This module may import anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from adapters.blas import blas_in_use
from adapters.http.internal_wire import info_json
from adapters.kv.shm_outbox import ShmOutbox
from effects.interpret import EnginePerformer, NodeRequest
from effects.ports import Engine
from effects.runner import NodeRunner, RunnerGeneration, open_generation
from statecore.errors import Code, ErrorInfo, Fault
from statecore.events import Admitted
from statecore.ids import RequestId

DEVICE_THREAD: Final = "the MLX device thread"  # what runs a node's engine by default
CORE_PROCESS: Final = "the engine core process"  # ... with --engine-core process


class NodeStatus:
    """One node's health, info and statistics, and its admission of requests."""

    def __init__(
        self,
        role: str,
        engine: Engine,
        runner: NodeRunner[Any],
        performer: EnginePerformer,
        *,
        max_live: int,
        kv_buffer_bytes: Callable[[], int],
        warnings: list[str],
        kv_stream: bool,
        shm: ShmOutbox | None,
        runs_engine: str,
        kv_plane_bodies: Callable[[], int],
    ) -> None:
        self.role = role
        self.engine = engine
        self.runner = runner
        self.performer = performer
        self.max_live = max_live
        self.kv_buffer_bytes = kv_buffer_bytes  # a decode node's kept receive buffers
        self.warnings = warnings  # start-up warnings, repeated in /health
        # whether this node takes part in streamed handoffs (not a tensor- or pipeline-parallel one)
        self.kv_stream = kv_stream
        self.shm = shm  # a prefill node's shared memory for streamed pieces to decode nodes on this host
        self.runs_engine = runs_engine  # what runs the engine (DEVICE_THREAD or CORE_PROCESS): what dies
        self.kv_plane_bodies = kv_plane_bodies  # KV bodies the plane answered (streams and pulls)
        self.lost_reason: str | None = None  # why the engine (this node's transport) is lost
        self.kv_port: int | None = None  # the KV plane's port, once it listens (a prefill node's)
        self.blas: str | None = None  # what the engine computes with, when its node knows (else MLX is asked)

    def lose(self, reason: str) -> None:
        """The engine (this node's transport) is lost: health says why from now on."""
        self.lost_reason = reason

    def engine_lost(self) -> str | None:
        """Why this node's engine is lost (its loop ends and the node exits soon), or None."""
        if self.lost_reason is not None:
            return self.lost_reason
        if not self.engine.liveness().alive:  # asked on every admission: the cheap question
            return f"{self.runs_engine} is not running"
        return None

    async def admit(self, rid: RequestId, context: NodeRequest, capacity: int) -> RunnerGeneration:
        """Open the request's generation in the runner (`capacity`: its outputs' channel), refused
        as a failed peer while the engine is lost (`lost_engine`)."""
        return await open_generation(self.runner, rid, capacity, context, max_live=self.max_live,
                                     faults=self.performer.faults, refusal=self.lost_engine())

    async def admit_prefill(self, rid: RequestId, context: NodeRequest) -> RunnerGeneration:
        """A prefill node's request admitted (`admit`: its outputs are the first token, or why
        not) and its prefill started (`Admitted`)."""
        generation = await self.admit(rid, context, 4)
        await self.runner.post(rid, Admitted(len(context.prompt)))
        return generation

    def lost_engine(self) -> ErrorInfo | None:
        """Between its device's death and its loop's end (it then exits) the node is a failed peer
        to whoever asks, not a bug of the request: the router tries another node."""
        if (lost := self.engine_lost()) is None:
            return None
        return ErrorInfo(Fault.PEER, Code.ENGINE_FAILED,
                         f"this node's engine is lost ({lost}): it is going down")

    async def health(self, request: Request) -> Response:
        details: dict[str, object] = {"warnings": self.warnings} if self.warnings else {}
        if (lost := self.engine_lost()) is not None:
            details["reason"] = lost
        elif not self.runner.ready():
            phase = self.runner.statistics().phase.value
            details["reason"] = f"the serving loop is not accepting requests ({phase})"
        else:
            return JSONResponse({"status": "ok", **details})
        return JSONResponse({"status": "unavailable", **details}, status_code=503)

    async def info(self, request: Request) -> Response:
        shared: dict[str, object] = {} if self.shm is None else {"kv_shm": self.shm.advert().model_dump()}
        if self.kv_port is not None:
            shared["kv_port"] = self.kv_port
        if self.shm is not None and self.engine.info.device_pieces:
            shared["kv_device"] = True  # streamed pieces may stay in GPU memory for who asks
        streams = self.kv_stream and self.role in ("prefill", "decode")
        # kv_attach: it takes a streamed handoff's prefill started by the router, and attaches to one
        return JSONResponse({**info_json(self.engine.info), "blas": self.blas or blas_in_use(),
                             "kv_stream": streams, "kv_attach": streams, **shared})

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.statistics())

    async def handoffs(self, request: Request) -> Response:
        return JSONResponse(self.performer.handoffs.snapshot())

    def statistics(self) -> dict[str, object]:
        engine = self.engine.statistics()
        runner = self.runner.statistics()
        return {
            "role": self.role,
            "loop_phase": runner.phase.value,
            "live_requests": runner.live_requests,
            "live_tasks": runner.live_tasks,
            "contexts": runner.entries,
            "outcomes": runner.outcomes,
            "bugs": runner.bugs,
            "decoding": engine.decoding,
            "held_caches": engine.held_caches,
            "held_bytes": engine.held_bytes,
            "kv_arriving": engine.arriving,  # streamed handoffs' pieces kept, not yet installed
            # shared memory held for streamed pieces not yet taken (a prefill node's)
            "kv_shm_held_bytes": 0 if self.shm is None else self.shm.statistics().held_bytes,
            "kv_plane_bodies": self.kv_plane_bodies(),  # KV bodies sent on the KV plane's socket
            # KV pulls and streamed handoffs waiting for a request's KV (a prefill node's)
            "kv_waiting": len(self.performer.kv_pulls) + len(self.performer.kv_streams),
            "device_thread_alive": engine.device_thread_alive,
            "engine_step_retries": engine.step_retries,
            "engine_rows_isolated": engine.rows_isolated,
            "kv_reserved_bytes": engine.kv_reserved_bytes,
            "kv_budget_bytes": engine.kv_budget_bytes,
            "device_memory_bytes": engine.device_memory_bytes,
            "device_peak_bytes": engine.device_peak_bytes,
            "prefix_cache_bytes": engine.prefix_cache_bytes,
            "prefix_cache_hits": engine.prefix_cache_hits,
            "prefix_tokens_reused": engine.prefix_tokens_reused,
            "prefix_cache_queries": engine.prefix_cache_queries,
            "prefix_cache_evictions": engine.prefix_cache_evictions,
            "prefix_host": {"bytes": engine.prefix_host_bytes,
                            "capacity_bytes": engine.prefix_host_capacity_bytes,
                            "blocks_out": engine.prefix_host_out, "blocks_back": engine.prefix_host_back,
                            "blocks_forgotten": engine.prefix_host_forgotten},
            "prefill_capped_steps": engine.prefill_capped_steps,
            "activation_overruns": engine.activation_overruns,
            "activation_estimate_peak_bytes": engine.activation_estimate_peak_bytes,
            "conversations_kept": engine.conversations_kept,
            "speculative": {"steps": engine.speculative_steps, "drafted": engine.speculative_drafted,
                            "accepted": engine.speculative_accepted, "emitted": engine.speculative_emitted,
                            "off_reason": engine.speculative_off_reason or None},
            "kv_receive_buffer_bytes": self.kv_buffer_bytes(),  # kept for reuse, not a leak
            "device_time": {kind: {"calls": calls, "seconds": round(seconds, 6)}
                            for kind, calls, seconds in engine.device_time},
        }


__all__ = ["CORE_PROCESS", "DEVICE_THREAD", "NodeStatus"]
