"""A request's way into the decoder, on the device thread: `Joining.join` performs a
`DecodeHeld` or an `Install` command, and `stage` / `take_device_piece` a streamed handoff's
pieces as they arrive before it.

A request joins with the cache it decodes from: its prompt's, held here since its prefill, or a
handed-off one (a payload built in a worker thread, streamed pieces joined by layer range, the
pieces already staged in its slot as they arrived, `adapters.mlx.staging`; on a tensor-parallel
instance each rank's own heads, handed out by rank 0). The cache is taken and checked before
anything changes; a first token (or the tokens a prompt's last call verified after it) that
already ends the request gives it a short stream and no row; otherwise its lane is chosen
(`statecore.engine_schedule.choose_lane`), its KV reserved where it grows outside the slot pool,
and its row entered (`DeviceLoop.enter`), or it waits for its siblings (n > 1). A
piece read lazily from the sender's GPU memory (`adapters.mlx.device_read`) is settled before
its install is answered, since the sender frees the region then. Built by the performer once the
model is loaded, from what the load found. This module imports mlx-lm and trio only through
what it calls, for the types of a stream and a cache; statecore and effects never import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import trio
from mlx_lm.models.cache import KVCache

from adapters.kv import codec, frames
from adapters.mlx import commands, device_pieces, device_read
from adapters.mlx.batch_lane import batchable
from adapters.mlx.device import DeviceLoop
from adapters.mlx.distributed import LockstepLoop
from adapters.mlx.first_verify import verified_items
from adapters.mlx.grammar import constraint_after
from adapters.mlx.jobs import Job, Local, StreamItem, StreamSend, deliver, post
from adapters.mlx.load_on_device import Loaded
from adapters.mlx.payloads import joined_segments, kv_cache, validate_and_build
from adapters.mlx.rows import Live
from adapters.mlx.sampling import PositionSampler, request_seed
from statecore.engine_schedule import EnginePhase, Finish, choose_lane
from statecore.errors import Code, StatecoreError, client_error
from statecore.policy import finish_before_decoding

__all__ = ["Joining", "forget_drafts", "not_held"]


class Joining:
    """Joins requests into `device`'s decoder (see the module's paragraph)."""

    def __init__(self, device: DeviceLoop, loaded: Loaded, reads: device_read.Reads) -> None:
        self.device = device
        self.loaded = loaded
        self.reads = reads  # the performer's: a cancel forgets a request's reads

    # -- a streamed handoff's pieces, before the join --------------------------------------------

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

    def take_device_piece(self, command: commands.TakeDevicePiece) -> list[Any] | None:
        """A piece in the sender's GPU memory copied out (read lazily where it can be), then
        staged where `command.stage` says; its caches where it was not staged."""
        piece = command.piece
        assert isinstance(piece, device_pieces.DevicePiece)
        arrays, landing = device_pieces.take(piece)
        if landing is not None:
            self.reads.add(command.request_id, landing)
        caches = [kv_cache(keys, values, piece.token_count)
                  for keys, values in zip(arrays[::2], arrays[1::2], strict=True)]
        if command.stage is not None and self.stage(replace(command.stage, in_device_memory=True), caches):
            return None
        return caches

    # -- the join ------------------------------------------------------------------------------

    def join(self, command: commands.DecodeHeld | commands.Install, job: Job[Any],
             local: Local | None, matcher: Any) -> None:
        """Put a request into the decoder: its cache taken (validated: nothing changes before),
        its lane chosen, its KV reserved where it grows outside the slot pool. A first token that
        already ends it gives an empty stream. `matcher`: its grammar's (None: free text)."""
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
            self._join_with(command, local, matcher, send, token)
        except BaseException:
            device.slots.staged.unstage(device.pool, request_id)
            raise

    def _join_with(self, command: commands.DecodeHeld | commands.Install, local: Local | None, matcher: Any,
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
            forget_drafts(device, request_id, emitted=len(items))
            post(token, deliver, [*((send, item, False) for item in items[:-1]),
                                  (send, items[-1] if items else None, True)])
            device.publish()
            return
        if items:
            tokens = [*tokens, first_token, *(item.token for item in items[:-1])]
            first_token = items[-1].token
        remaining = sampling.max_tokens - 1 - len(items)
        # The grammar's state after the first token, which the prefill node drew under it.
        constraint = constraint_after(matcher, self.loaded.info, (first_token,))
        lane = choose_lane(plain_kv=all(type(c) is KVCache for c in cache),
                           needed_tokens=len(tokens) + remaining + 2,
                           slot_capacity=None if device.pool is None else device.pool.max_capacity,
                           batchable=batchable(cache), constrained=constraint is not None).value
        # A request stages only where its whole length fits a slot of plain KVCache layers
        # (`adapters.mlx.staging`), which is where `choose_lane` puts it.
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
        self.into_lane(live, cache, tokens, lane, reserved)
        if items:
            post(token, deliver, [(send, item, False) for item in items])
            if device.speculator is not None:
                device.speculator.emitted += len(items)
        device.publish()

    def into_lane(self, live: Live, cache: list[Any], prompt: list[int], lane: str,
                  reserved: int | None) -> None:
        """Put a request with its prompt's cache into `lane` (capacity was checked), its record
        reserving `reserved` bytes from now (None: what it reserves already); a choice of n > 1
        bound for a batched lane waits for its siblings first (`adapters.mlx.choices`)."""
        device = self.device
        if lane != "solo" and live.sampler.sampling.choices > 1 and device.choices.waits(live):
            record = device.requests.join(live, lane, (cache, prompt))
        else:
            device.enter(live, cache, prompt, lane)
            record = device.requests.join(live, lane, None)
        if reserved is not None:
            record.reserved = reserved
        if lane == "slot" and record.phase is EnginePhase.RUNNING:
            record.reserved = 0  # its KV lives in the pool now
        if device.choices.groups:
            device.choices.release()

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

    # -- the cache it decodes from -------------------------------------------------------------

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
        device, loaded = self.device, self.loaded
        if local is None:  # a rank > 0 of a sliced install: its heads, from rank 0
            assert isinstance(device, LockstepLoop) and command.sliced
            payload = device.receive_slice()
            caches = validate_and_build(payload, len(tokens), fingerprint=loaded.info.fingerprint,
                                        classes=loaded.classes,
                                        heads=(device.tensor.rank, device.tensor.size))
        elif command.request_id in device.slots.staged:  # its pieces are in its slot
            staged = device.slots.staged
            for first_layer, _, start, built in local.pieces or ():  # its last, staged now
                staged.stage(device.pool, command.request_id, first_layer, start, built, len(tokens),
                             len(tokens) + command.sampling.max_tokens + 1, room=True, decoding=True)
            decoding = any(live.slot is not None for live in device.live.values())
            staged.ready(device.pool, command.request_id, decoding=decoding)
            caches = device.slots.staged.views(device.pool, command.request_id)
        elif local.pieces is not None:
            caches = joined_segments(len(tokens), local.pieces, len(loaded.classes))
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
                tensors = codec.host_tensors(caches, fingerprint=self.loaded.info.fingerprint,
                                             token_count=len(tokens), heads=heads)
                slices.append([*frames.unsealed_pieces(tensors), frames.end_frame(tensors)])
        except BaseException:
            # The other ranks wait for their slice: a byte that is no payload makes their command
            # fail as this one does, so every rank still holds the same requests.
            device.pass_on_slices([[b"\x00"]] * (len(ranges) - 1))
            raise
        device.pass_on_slices(slices)
        return device.own_heads(caches)


def forget_drafts(device: DeviceLoop, request_id: str, emitted: int = 0) -> None:
    """A request that will not decode here (any more): its draft model cache goes; `emitted`
    tokens its prompt's last call verified were handed out."""
    speculator = device.speculator
    if speculator is not None:
        speculator.left(request_id)
        speculator.emitted += emitted


def not_held(request_id: str) -> StatecoreError:
    return StatecoreError(
        client_error(f"no prefilled cache is held for request {request_id!r}", Code.KV_NOT_FOUND)
    )


def _nowhere() -> trio.MemorySendChannel[StreamItem]:
    """A replayed request's stream: its tokens go nowhere."""
    send, _ = trio.open_memory_channel[StreamItem](0)
    return send
