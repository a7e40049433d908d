"""The device thread's side of the engine's commands: `Performer.perform(job)` does what a
command of `adapters.mlx.commands` asks, on the device loop, and returns its outcome.

The facade (`adapters.mlx.engine.MlxEngine`) checks a call's arguments in trio, builds what needs
no device (a payload's caches, a grammar matcher) in worker threads, posts the command with those
(`adapters.mlx.jobs.Local`) and awaits the outcome; this performs it. A rank > 0 of a tensor- or
pipeline-parallel instance performs the very commands rank 0 broadcast, through this same
function, without a `Local`: its tokens go nowhere, a grammar is compiled here, a sliced
install's heads come from rank 0. It also holds what the load found (the model's `info`, its
cache classes, its grammars) and the statistics snapshot it refreshes after each change. Only the
device thread calls it. This module imports mlx, mlx-lm and trio (for the types of a stream);
statecore and effects never import it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, assert_never, cast

import mlx.core as mx
import trio

from adapters.grammar import Grammars
from adapters.kv import codec, frames
from adapters.mlx import commands, device_pieces, device_read, managed_memory
from adapters.mlx.device import DeviceLoop
from adapters.mlx.distributed import LockstepLoop
from adapters.mlx.first_verify import verified_items
from adapters.mlx.grammar import TokenConstraint
from adapters.mlx.jobs import Job, Local, StreamItem, StreamSend, deliver, post
from adapters.mlx.load_on_device import ModelSource, load_on_device
from adapters.mlx.payloads import joined_segments, kv_cache, validate_and_build
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.requests import EngineRequest
from adapters.mlx.rows import Live
from adapters.mlx.sampling import PositionSampler, request_seed
from adapters.mlx.settings import Settings
from effects.engine_port import EngineStatistics, ModelInfo, PrefixSummary, SamplingParams
from statecore.engine_schedule import EnginePhase, Finish
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.policy import finish_before_decoding
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

    def perform(self, job: Job[Any]) -> Any:
        command, local = job.command, job.local
        match command:
            case commands.Load(settings):
                loaded = load_on_device(self.device, self.source, Settings(**settings))
                self.settings = self.device.settings  # rank 0's, as the load set them
                self.info, self.classes, self.grammars = loaded.info, loaded.classes, loaded.grammars
                self.publish()  # what the load set up (e.g. speculation's verdict) shows at once
                return loaded.info
            case commands.Prefill():
                self.register(command, job, local)
                return None
            case commands.DecodeHeld() | commands.Install():
                self.join(command, job, local)
                return None
            case commands.StagePiece():
                assert local is not None and local.caches is not None
                return self.stage(command, local.caches)
            case commands.TakeDevicePiece(piece, request_id, stage):
                assert isinstance(piece, device_pieces.DevicePiece)
                arrays, landing = device_pieces.take(piece)
                if landing is not None:
                    self.reads.add(request_id, landing)
                caches = [kv_cache(keys, values, piece.token_count)
                          for keys, values in zip(arrays[::2], arrays[1::2], strict=True)]
                if stage is not None and self.stage(replace(stage, in_device_memory=True), caches):
                    return None
                return caches
            case commands.Cancel(request_id):
                self.device.drop(request_id)
                self.reads.forget(request_id)
                self.forget_drafts(request_id)
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
                                  self.constraint(matcher, ()))
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

    def join(self, command: commands.DecodeHeld | commands.Install, job: Job[Any],
             local: Local | None) -> None:
        """Put a request into the decoder: its cache taken (validated: nothing changes before),
        its lane chosen, its KV reserved where it grows outside the slot pool. A first token that
        already ends it gives an empty stream."""
        device = self.device
        request_id = command.request_id
        # Its pieces read from the sender's GPU memory are done before the install is answered
        # (the sender frees their regions then); a step has computed them already, as a rule.
        self.reads.settle(request_id)
        send = local.send if local is not None and local.send is not None else _nowhere()
        token = cast(trio.lowlevel.TrioToken, job.token)  # None (replayed): post() delivers nothing
        if request_id in device.live:
            raise StatecoreError(client_error(f"request {request_id!r} is already decoding"))
        staged = request_id in device.slots.staged  # its slot is taken already: it counts there
        overloaded = None if staged else device.admission.overloaded()
        if overloaded is not None:
            raise overloaded
        try:
            self.join_with(command, job, local, send, token)
        except BaseException:
            device.slots.staged.unstage(device.pool, request_id)
            raise

    def join_with(self, command: commands.DecodeHeld | commands.Install, job: Job[Any], local: Local | None,
                  send: StreamSend, token: trio.lowlevel.TrioToken) -> None:
        device = self.device
        request_id, tokens, sampling = command.request_id, list(command.tokens), command.sampling
        first_token = command.first_token
        # A handed-off prompt's chunks go into the prefix cache after its first step (`Live.keep_prompt`),
        # except on an instance, whose ranks keep the same blocks on the same step
        keeps_later = (isinstance(command, commands.Install) and device.joins_early
                       and not isinstance(device, LockstepLoop))
        cache = self.take_cache(command, local, keep=not keeps_later)
        ended = finish_before_decoding(first_token, device.eos, ignore_eos=sampling.ignore_eos,
                                       max_tokens=sampling.max_tokens)
        # The tokens the prompt's last call verified after the first (speculative decoding's
        # first verify step): they go out first, and the request decodes from the last of them.
        after = self.verified_after(command, first_token) if ended is None else []
        items = verified_items(after, sampling, device.eos)
        if items and items[-1].finish_reason is not None:
            ended = items[-1].finish_reason
        if ended is not None:
            record = device.requests.get(request_id)
            if record is not None and record.phase is EnginePhase.HELD:
                device.requests.remove(request_id, Finish(ended))
            if keeps_later:  # no step of it comes: kept now, its staged slot still its own
                device.keeping.keep_installed(tokens, cache)
            device.slots.staged.unstage(device.pool, request_id)
            device.choices.ended(sampling)
            self.forget_drafts(request_id, emitted=len(items))
            post(token, deliver, [*((send, item, False) for item in items[:-1]),
                                  (send, items[-1] if items else None, True)])
            self.publish()
            return
        if items:
            tokens = [*tokens, first_token, *(item.token for item in items[:-1])]
            first_token = items[-1].token
        remaining = sampling.max_tokens - 1 - len(items)
        # The grammar's state after the first token, which the prefill node drew under it.
        constraint = self.constraint(self.matcher(sampling, local), (first_token,))
        lane = device.lane_for(cache, len(tokens), remaining, constraint is not None)
        # A request stages only where its whole length fits a slot of plain KVCache layers
        # (`adapters.mlx.staging`), which is where `lane_for` puts it.
        assert lane == "slot" or request_id not in device.slots.staged
        reserved = None
        if lane != "slot":  # its cache grows to the whole request, outside the pool
            total = len(command.tokens) + sampling.max_tokens
            reserved = device.admission.admit(request_id, device.cost.of(total), total)
        sampler = PositionSampler(sampling, request_seed(request_id, sampling), len(tokens) + 1,
                                  [*tokens, first_token], constraint)
        live = Live(request_id, send, token, remaining, sampler, first_token,
                    prompt_tokens=len(command.tokens))
        if device.settings.keep_conversations and device.prefix is not None:
            live.conversation = [*tokens, first_token]
        if keeps_later:
            live.keep_prompt = (list(command.tokens), None if lane == "slot" else cache)
        device.join(live, cache, tokens, lane, reserved)
        if items:
            post(token, deliver, [(send, item, False) for item in items])
            if device.speculator is not None:
                device.speculator.emitted += len(items)
        self.publish()

    def verified_after(self, command: commands.DecodeHeld | commands.Install, first_token: int) -> list[int]:
        """The tokens after the first that the held prompt's last call verified (none for an
        install); a decode from another first token than that call's starts from the prompt."""
        held = self.device.held.get(command.request_id) if isinstance(command, commands.DecodeHeld) else None
        if held is None or not held.drawn:
            return []
        if held.drawn[0] != first_token:
            held.cut_to_prompt()
            return []
        return list(held.drawn[1:])

    def forget_drafts(self, request_id: str, emitted: int = 0) -> None:
        """A request that will not decode here (any more): its draft model cache goes; `emitted`
        tokens its prompt's last call verified were handed out."""
        speculator = self.device.speculator
        if speculator is not None:
            speculator.left(request_id)
            speculator.emitted += emitted

    def stage(self, command: commands.StagePiece, caches: list[Any]) -> bool:
        """A streamed handoff's piece into its request's slot, where it can go there
        (`adapters.mlx.staging`); whether it did."""
        device = self.device
        first = command.request_id not in device.slots.staged
        staged: bool = device.slots.staged.stage(
            device.pool, command.request_id, command.first_layer, command.start, caches,
            command.prompt_tokens, command.needed_tokens,
            room=not first or device.admission.overloaded() is None,
            decoding=any(live.slot is not None for live in device.live.values()),
            in_device_memory=command.in_device_memory)
        if staged and first:  # the step it joins will trace nothing new
            slot = device.slots.staged.entries[command.request_id].slot
            device.slots.prepare_join(slot, command.prompt_tokens, device.live.values())
        return staged

    def take_cache(self, command: commands.DecodeHeld | commands.Install, local: Local | None, *,
                   keep: bool = True) -> list[Any]:
        """The cache a request decodes from: its held one, or a handed-off one (built from its
        payload or streamed pieces; on an instance, each rank's own heads), its whole chunks
        kept now where `keep`."""
        tokens = command.tokens
        if isinstance(command, commands.DecodeHeld):
            held = self.device.held.get(command.request_id)
            if held is None:
                raise not_held(command.request_id)
            if held.prompt_tokens != len(tokens):
                raise StatecoreError(client_error(
                    f"request {command.request_id!r}: the held cache covers {held.prompt_tokens} "
                    f"tokens, the prompt has {len(tokens)}"))
            return held.cache
        device = self.device
        if local is None:  # a rank > 0 of a sliced install: its heads, from rank 0
            assert isinstance(device, LockstepLoop) and command.sliced
            payload = device.receive_slice()
            caches = validate_and_build(payload, len(tokens), fingerprint=self.model_info.fingerprint,
                                        classes=self.classes, heads=(device.tensor.rank, device.tensor.size))
        elif command.request_id in device.slots.staged:  # its pieces are in its slot
            staged = device.slots.staged
            for first_layer, _, start, built in local.pieces or ():  # its last, staged now
                staged.stage(device.pool, command.request_id, first_layer, start, built, len(tokens),
                             len(tokens) + command.sampling.max_tokens + 1, room=True, decoding=True)
            decoding = any(live.slot is not None for live in device.live.values())
            staged.ready(device.pool, command.request_id, decoding=decoding)
            caches = device.slots.staged.views(device.pool, command.request_id)
        elif local.pieces is not None:
            caches = joined_segments(len(tokens), local.pieces, len(self.classes))
        else:
            assert local.caches is not None
            caches = local.caches
            if command.sliced:
                assert local.ranges is not None
                caches = self.hand_out_heads(caches, local.ranges, tokens)
        # Its whole chunks kept for the conversation's next turn (on every rank alike); the next
        # step decodes only: the request's second token waits for no prefill.
        if keep:
            device.keeping.keep_installed(tokens, caches)
        device.handoff_joined = True
        return caches

    def hand_out_heads(self, caches: list[Any], ranges: list[tuple[int, int]],
                       tokens: Sequence[int]) -> list[Any]:
        """Rank 0 of a TP decode instance: each other rank's heads of an installed payload, sent to
        it as a payload of that head range; rank 0 keeps its own."""
        device = self.device
        assert isinstance(device, LockstepLoop)
        slices: list[list[bytes | memoryview]] = []
        try:
            for heads in ranges[1:]:  # views of the cache's own buffers: copied once, into the send
                tensors = codec.host_tensors(caches, fingerprint=self.model_info.fingerprint,
                                             token_count=len(tokens), heads=heads)
                slices.append([*frames.unsealed_pieces(tensors), frames.end_frame(tensors)])
        except BaseException:
            # The other ranks wait for their slice: a byte that is no payload makes their command
            # fail as this one does, so every rank still holds the same requests.
            device.pass_on_slices([[b"\x00"]] * (len(ranges) - 1))
            raise
        device.pass_on_slices(slices)
        return device.own_heads(caches)

    def release(self, request_id: str) -> int:
        device = self.device
        device.slots.staged.release(device.pool, request_id)  # pieces of a request that ended first
        held = device.held.get(request_id)
        if held is not None:
            device.requests.remove(request_id, Finish.RELEASED)  # its reservation with it
            device.choices.ended(held.sampling)  # it will not decode here
            self.forget_drafts(request_id)
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

    def constraint(self, matcher: Any, generated: Sequence[int]) -> TokenConstraint | None:
        """The request's grammar state after `generated` (None: free text)."""
        if matcher is None:
            return None
        info = self.model_info
        try:
            return TokenConstraint(matcher, info.vocab_size, info.eos_token_ids, generated)
        except RuntimeError as exc:
            raise StatecoreError(client_error(f"the first token does not fit the response_format: {exc}",
                                              param="response_format")) from exc

    # -- statistics ----------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        assert self.info is not None, "a command before the load"
        return self.info

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

    def cache_bytes(self, cache: list[Any]) -> int:
        """What a held cache weighs: its live tensors, as the wire would carry them."""
        if self.model_info.can_travel:
            return codec.raw_tensor_bytes(cache)
        return sum(int(getattr(c, "nbytes", 0)) for c in cache)


def _nowhere() -> trio.MemorySendChannel[StreamItem]:
    """A replayed request's stream: its tokens go nowhere."""
    send, _ = trio.open_memory_channel[StreamItem](0)
    return send


def not_held(request_id: str) -> StatecoreError:
    return StatecoreError(
        client_error(f"no prefilled cache is held for request {request_id!r}", Code.KV_NOT_FOUND)
    )


def _read_by_the_host(tensors: frames.HostTensors) -> frames.HostTensors:
    """An export's tensors as the host reads them next (framed, checksummed, copied out): on CUDA
    moved to the host in bulk, or copied there by the copy engine (`managed_memory`)."""
    managed_memory.to_host(tensors.runs)
    runs = managed_memory.host_copies(tensors.runs)
    if all(run is held for run, held in zip(runs, tensors.runs, strict=True)):  # (not ==: that reads them)
        return tensors
    copied = [memoryview(run).cast("B") for run in runs]
    return frames.HostTensors(tensors.header_bytes, copied, tensors.version)
