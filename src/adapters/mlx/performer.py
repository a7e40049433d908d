"""The device thread's side of the engine's commands: `Performer.perform(job)` does what a
command of `adapters.mlx.commands` asks, on the device loop, and returns its outcome.

The facade (`adapters.mlx.engine.MlxEngine`) checks a call's arguments in trio, builds what needs
no device (a payload's caches, a grammar matcher) in worker threads, posts the command with those
(`adapters.mlx.jobs.Local`) and awaits the outcome; this performs it. A rank > 0 of a tensor- or
pipeline-parallel instance performs the very commands rank 0 broadcast, through this same
function, without a `Local`: its tokens go nowhere, a grammar is compiled here, a sliced
install's heads come from rank 0. Here: the load, a prompt's admission, a held cache's release and
export, the prefix cache's commands; a request's join into the decoder and a streamed handoff's
pieces before it are `adapters.mlx.joining`'s. It also holds what the load found (the model's
`info`, its cache classes, its grammars), the device pieces read lazily until their install
(`adapters.mlx.device_read.Reads`) and the statistics snapshot it refreshes after each change.
Only the device thread calls it. This module imports mlx and mlx-lm; statecore and effects never
import it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, assert_never

import mlx.core as mx

from adapters.grammar import Grammars
from adapters.kv import codec, frames
from adapters.mlx import commands, device_read, managed_memory
from adapters.mlx.device import DeviceLoop
from adapters.mlx.distributed import LockstepLoop
from adapters.mlx.grammar import constraint_after
from adapters.mlx.jobs import Job, Local
from adapters.mlx.joining import Joining, forget_drafts, not_held
from adapters.mlx.load_on_device import ModelSource, load_on_device
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.requests import EngineRequest
from adapters.mlx.sampling import PositionSampler, request_seed
from adapters.mlx.settings import Settings
from effects.engine_port import EngineStatistics, ModelInfo, PrefixSummary, SamplingParams
from statecore.engine_schedule import EnginePhase, Finish
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.prefix import prompt_chunks
from statecore.routing import summary_key
from statecore.scheduling import StepRates, prefill_units

__all__ = ["Performer"]

logger = logging.getLogger("adapters.engine_mlx")


class Performer:
    """Performs each command on `device` (see the module's paragraph)."""

    def __init__(self, device: DeviceLoop, settings: Settings, source: ModelSource) -> None:
        self.device = device
        self.settings = settings
        self.source = source
        self.info: ModelInfo | None = None  # set by the load
        self.classes: list[str] = []  # each cache layer's class, as a payload must carry them
        self.grammars: Grammars | None = None  # structured output: set by the load
        self.stats = EngineStatistics(0, 0, 0, True)  # replaced whole (one atomic assignment)
        self.reads = device_read.Reads()  # device pieces read lazily, settled at their install
        self._joining: Joining | None = None  # set by the load

    def perform(self, job: Job[Any]) -> Any:
        command, local = job.command, job.local
        match command:
            case commands.Load(settings):
                loaded = load_on_device(self.device, self.source, Settings(**settings))
                self.settings = self.device.settings  # rank 0's, as the load set them
                self.info, self.classes, self.grammars = loaded.info, loaded.classes, loaded.grammars
                self._joining = Joining(self.device, loaded, self.reads)
                self.publish()  # what the load set up (e.g. speculation's verdict) shows at once
                return loaded.info
            case commands.Prefill():
                self.register(command, job, local)
                return None
            case commands.DecodeHeld() | commands.Install():
                self.joining.join(command, job, local, self.matcher(command.sampling, local))
                return None
            case commands.StagePiece():
                assert local is not None and local.caches is not None
                return self.joining.stage(command, local.caches)
            case commands.TakeDevicePiece():
                return self.joining.take_device_piece(command)
            case commands.Cancel(request_id):
                self.device.drop(request_id)
                self.reads.forget(request_id)
                forget_drafts(self.device, request_id)
                self.publish()
                return None
            case commands.Release(request_id):
                return self.release(request_id)
            case commands.Export(request_id):
                return self.export(request_id)
            case commands.ForgetPrefixes():
                self.device.keeping.forget_prefixes()
                self.device.executor.memory.forget_counts()
                # The warm-up's steps traced and compiled: as rates they would make a fast
                # device's streamed prompts look slow and slice them (H100: a 1B model's
                # 2,000-token prefill 1.8x longer in three slices).
                self.device.rates = StepRates()
                self.publish()
                return None
            case commands.Keep(tokens):
                assert local is not None and local.caches is not None
                kept = self.device.keeping.keep_imported(tokens, local.caches)
                self.publish()
                return kept
            case commands.ExportPrefix(tokens):
                return self.export_prefix(tokens)
            case commands.EvictPrefixes(nbytes):
                return self.evict_prefixes(nbytes)
            case commands.SummarizePrefixes():
                prefix = self.device.prefix
                assert prefix is not None
                keys = tuple(summary_key(key) for key in prefix.index.cached_keys())
                return PrefixSummary(prefix.chunk_size, prefix.index.version, keys,
                                     tuple(sorted(prefix.ends)))
            case commands.Inspect(look):
                return look()
            case commands.Stop():
                raise AssertionError("the loop handles Stop itself")
            case _:
                assert_never(command)

    # -- requests ------------------------------------------------------------------------------

    def register(self, command: commands.Prefill, job: Job[Any], local: Local | None) -> None:
        """Admit a prompt's KV and queue its prefill (its job is finished when its first token
        is read back)."""
        device = self.device
        request_id, tokens, sampling = command.request_id, list(command.tokens), command.sampling
        if request_id in device.requests:
            raise StatecoreError(client_error(f"request {request_id!r} is already in use"))
        chunks = prompt_chunks(tokens, self.settings.prefill_chunk_size, device.block_ends,
                               rule=device.message_blocks)
        units = prefill_units(chunks, device.layers, device.unit_tokens, device.inner_points)
        keys = device.keeping.touch_prefix(tokens)  # so that its own admission evicts them last
        reservation = device.admission.prefill_reservation(len(tokens), sampling.max_tokens)
        reserved = device.admission.admit(request_id, *reservation)
        device.arrivals += 1
        matcher = self.matcher(sampling, local)
        sampler = PositionSampler(sampling, request_seed(request_id, sampling), len(tokens), tokens,
                                  constraint_after(matcher, self.model_info, ()))
        task = PrefillTask(request_id, tokens, sampler, device.arrivals, chunks, units, job=job,
                           segment_sink=None if local is None else local.segment_sink)
        # Its record (and so its reservation) first: the blocks its start takes back from the host
        # tier fit what the budget leaves beside every reservation, its own included.
        device.requests.add(EngineRequest(request_id, EnginePhase.WAITING, reserved=reserved, task=task))
        try:
            device.keeping.start_from_prefix(task, keys)
        except BaseException:
            device.requests.remove(request_id, Finish.FAILED)
            raise

    def release(self, request_id: str) -> int:
        device = self.device
        device.slots.staged.release(device.pool, request_id)  # pieces of a request that ended first
        held = device.held.get(request_id)
        if held is not None:
            device.requests.remove(request_id, Finish.RELEASED)  # its reservation with it
            device.choices.ended(held.sampling)  # it will not decode here
            forget_drafts(self.device, request_id)
        self.publish()
        return 0 if held is None else held.nbytes

    def export(self, request_id: str) -> frames.HostTensors:
        held = self.device.held.get(request_id)
        if held is None:
            raise not_held(request_id)
        held.cut_to_prompt()  # a handoff carries the prompt's cache (its decode node draws the rest)
        cache = held.cache
        if isinstance(self.device, LockstepLoop):  # every rank's heads, gathered on each
            cache = self.device.gather_heads(cache)
        tensors = codec.host_tensors(cache, fingerprint=self.model_info.fingerprint,
                                     token_count=held.prompt_tokens)
        return _read_by_the_host(tensors)

    # -- the prefix cache ----------------------------------------------------------------------

    def export_prefix(self, tokens: Sequence[int]) -> frames.HostTensors:
        """A fresh cache of the prefix cache's blocks of `tokens` (their concatenation; the blocks
        themselves are never handed out), as host tensors."""
        prefix = self.device.prefix
        _, cache = (0, None) if prefix is None else prefix.start(
            prefix.conversation_keys_of(tokens), counted=False)
        if cache is None or prefix is None:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.PREFIX_NOT_CACHED,
                                           "the prefix cache holds no whole block of these tokens"))
        mx.eval([c.state for c in cache])
        tensors = codec.host_tensors(cache, fingerprint=self.model_info.fingerprint,
                                     token_count=cache[0].offset)
        return _read_by_the_host(tensors)

    def evict_prefixes(self, nbytes: int) -> int:
        prefix = self.device.prefix
        if prefix is None:
            return 0
        before = prefix.nbytes
        prefix.evict(nbytes)
        self.publish()
        return before - prefix.nbytes

    # -- grammars ------------------------------------------------------------------------------

    def matcher(self, sampling: SamplingParams, local: Local | None) -> Any:
        """The request's grammar matcher: its caller's, or compiled here for a replayed command."""
        if local is not None:
            return local.matcher
        if sampling.response_format is None or self.grammars is None:
            return None
        return self.grammars.matcher(sampling.response_format)

    # -- statistics ----------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        assert self.info is not None, "a command before the load"
        return self.info

    @property
    def joining(self) -> Joining:
        assert self._joining is not None, "a join before the load"
        return self._joining

    def publish(self) -> None:
        """Refresh the statistics snapshot (one atomic assignment)."""
        device = self.device
        speculator, prefix = device.speculator, device.prefix
        self.stats = EngineStatistics(
            decoding=len(device.live),
            held_caches=len(device.held),
            held_bytes=sum(h.nbytes for h in device.held.values()),
            device_thread_alive=True,
            step_retries=device.step_retries,
            rows_isolated=device.rows_isolated,
            kv_reserved_bytes=device.requests.reserved_bytes,
            prefix_cache_bytes=0 if prefix is None else prefix.nbytes,
            prefix_cache_hits=0 if prefix is None else prefix.hits,
            prefix_tokens_reused=0 if prefix is None else prefix.tokens_reused,
            prefix_cache_queries=0 if prefix is None else prefix.queries,
            prefix_cache_evictions=0 if prefix is None else prefix.evictions,
            prefix_host_bytes=0 if prefix is None else prefix.host_nbytes,
            prefix_host_capacity_bytes=0 if prefix is None else prefix.index.host_capacity_bytes,
            prefix_host_out=0 if prefix is None else prefix.host_out,
            prefix_host_back=0 if prefix is None else prefix.host_back,
            prefix_host_forgotten=0 if prefix is None else prefix.host_forgotten,
            prefill_capped_steps=device.executor.memory.prefill_capped_steps,
            activation_overruns=device.executor.memory.activation_overruns,
            activation_estimate_peak_bytes=device.executor.memory.activation_peak,
            conversations_kept=device.keeping.conversations_kept,
            conversation_tokens_kept=device.keeping.conversation_tokens_kept,
            speculative_steps=0 if speculator is None else speculator.verify_steps,
            speculative_drafted=0 if speculator is None else speculator.drafted,
            speculative_accepted=0 if speculator is None else speculator.accepted,
            speculative_emitted=0 if speculator is None else speculator.emitted,
            speculative_off_reason="" if speculator is None else speculator.off_reason or "",
        )

    def statistics(self, alive: bool, stalled_s: float, arriving: int) -> EngineStatistics:
        """The snapshot with what the trio side knows beside it (whether the thread is alive, how
        long it has stalled, pieces arriving in trio) and what may be read from any thread."""
        device = self.device
        return replace(self.stats, device_thread_alive=alive, stalled_s=stalled_s,
                       arriving=arriving + len(device.slots.staged),
                       kv_budget_bytes=device.settings.kv_memory_bytes - device.pool_reserved,
                       device_memory_bytes=mx.get_active_memory(), device_peak_bytes=mx.get_peak_memory(),
                       device_time=tuple((kind, calls, seconds)
                                         for kind, (calls, seconds) in device.profile.spent.items()))

    def dead(self) -> None:
        """The device thread is gone: the snapshot says so."""
        self.stats = EngineStatistics(0, 0, 0, False, self.device.step_retries, self.device.rows_isolated)

    def cache_bytes(self, cache: list[Any]) -> int:
        """What a held cache weighs: its live tensors, as the wire would carry them."""
        if self.model_info.can_travel:
            return codec.raw_tensor_bytes(cache)
        return sum(int(getattr(c, "nbytes", 0)) for c in cache)


def _read_by_the_host(tensors: frames.HostTensors) -> frames.HostTensors:
    """An export's tensors as the host reads them next (framed, checksummed, copied out): on CUDA
    moved to the host in bulk, or copied there by the copy engine (`managed_memory`)."""
    managed_memory.to_host(tensors.runs)
    runs = managed_memory.host_copies(tensors.runs)
    if all(run is held for run, held in zip(runs, tensors.runs, strict=True)):  # (not ==: that reads them)
        return tensors
    copied = [memoryview(run).cast("B") for run in runs]
    return frames.HostTensors(tensors.header_bytes, copied, tensors.version)
