"""KV arriving on a decode node: a pulled payload built whole, or a streamed handoff's pieces
checked side by side and kept in order.

A pulled payload (`Engine.install`) is validated and built in a worker thread (framing, checksum,
header, then the arrays themselves, made from host memory: no device stream is involved), so a
big handoff never stalls the decode batch; on a tensor-parallel instance rank 0 also asks here
which KV heads each rank takes, before any rank waits for its slice.

Each piece of a streamed handoff is validated and built in a worker thread (framing, CRC-32,
header, fingerprint, classes, token count; `adapters.mlx.payloads.validate_segment`) beside the
pieces before it still being checked, up to PIECE_CHECKS at once, while the stream is read on;
then kept in the stream's order (`callers.PieceOrder`: a slot takes each layer's tokens in
order, and nothing is kept after a piece that failed): written into the request's slot where the
model's cache goes in slots (`StagePiece`, `adapters.mlx.staging`; a piece in the sender's GPU
memory is copied out and staged by one job, `TakeDevicePiece`), else kept for the install.
It imports trio; mlx only through what it calls (the device thread builds nothing here).
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Final

import trio

from adapters.mlx import commands
from adapters.mlx.callers import Callers
from adapters.mlx.device_pieces import DevicePiece, is_device_piece, parse
from adapters.mlx.device_pieces import enabled as device_pieces_enabled
from adapters.mlx.distributed import LockstepLoop
from adapters.mlx.jobs import Local
from adapters.mlx.payloads import validate_and_build, validate_segment
from effects.engine_port import KvBytes, KvSegment
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId

__all__ = ["PIECE_CHECKS", "ArrivingKv"]

# Pieces checked at once (CRC, arrays built: ~8 ms a 16 MiB piece on an H100's host, 9 on the CPU
# box), where the host has cores to spare beside the device thread and the front end; one on a
# small host, where a second check would slow the running streams' steps. Counted on the cores
# this process may use (a node pinned to one core checks one at a time).
PIECE_CHECKS: Final = max(1, min(4, len(os.sched_getaffinity(0)) // 4 if hasattr(os, "sched_getaffinity")
                                 else (os.cpu_count() or 1) // 4))


class ArrivingKv:
    """The decode side of `Engine.install` and `Engine.receive_segment` for one engine (trio only)."""

    def __init__(self, callers: Callers, device: Any, post: Callable[..., Awaitable[Any]],
                 model: Callable[[], tuple[Sequence[str], str]]) -> None:
        self._callers = callers
        self._device = device  # the device loop: its expected joins, staged slots, cache ranges
        self._post = post
        self._model = model  # the loaded model's (cache classes, fingerprint)
        self.checks = trio.CapacityLimiter(PIECE_CHECKS)

    async def built_payload(self, payload: KvBytes, prompt_tokens: int) -> Local:
        """A pulled payload's caches (and each rank's head range on a tensor-parallel instance)."""
        classes, fingerprint = self._model()
        caches = await trio.to_thread.run_sync(partial(
            validate_and_build, payload, prompt_tokens, fingerprint=fingerprint, classes=classes))
        device = self._device
        split = isinstance(device, LockstepLoop) and device.tensor.size > 1
        return Local(caches=caches, ranges=device.head_ranges(caches) if split else None)

    async def receive(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int, *,
                      max_tokens: int, index: int | None) -> None:
        """One piece checked and kept (`Engine.receive_segment`); refused by a tensor- or
        pipeline-parallel instance, which installs whole payloads only."""
        if isinstance(self._device, LockstepLoop):
            raise StatecoreError(ErrorInfo(
                Fault.PEER, Code.KV_MALFORMED,
                "this node installs whole payloads only (tensor or pipeline parallel)"))
        classes, fingerprint = self._model()
        order = self._callers.piece_order(request_id)
        if index is None:
            index = order.claim()
        last = segment.stop == prompt_tokens and segment.end_layer == len(classes)
        if last:  # the request joins once the pieces are checked and installed
            self._device.handoffs_coming[request_id] = time.monotonic()
        elif segment.last_step_started:  # and its last pieces are being computed now
            self._device.handoffs_expected.setdefault(request_id, time.monotonic())
        kept = False
        failure: StatecoreError | None = None  # its error, for an install that waits for it
        try:
            if is_device_piece(segment.payload.pieces[0]):
                piece = self._checked_device_piece(segment, fingerprint, classes)
                await order.turn(index)  # a request cancelled meanwhile takes nothing here
                await self._take_from_device(request_id, segment, prompt_tokens, max_tokens, piece)
            else:
                built = await trio.to_thread.run_sync(partial(
                    validate_segment, segment, prompt_tokens, fingerprint=fingerprint,
                    classes=classes, streams_ranges=self._device.streams_ranges), limiter=self.checks)
                await order.turn(index)  # a request cancelled meanwhile keeps nothing here
                await self._keep(request_id, segment, prompt_tokens, max_tokens, built, last=last)
            kept = True
        except StatecoreError as exc:
            failure = exc
            raise
        finally:
            order.done(index, kept=kept, failure=failure)

    async def all_kept(self, request_id: RequestId, pieces: int | None) -> None:
        """Wait until the request's first `pieces` pieces are kept (None: no wait): an install may
        be asked while the last ones are still being checked (`Engine.install_segments`), and
        starts once they are; raises if one of them failed or the request's handoff ended
        meanwhile."""
        if pieces is None:
            return
        # the order is made here when no piece's call has started yet (an engine core process
        # may start the install's call first when both came in one frame)
        await self._callers.piece_order(request_id).kept_all(pieces)

    async def _take_from_device(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int,
                                max_tokens: int, piece: DevicePiece) -> None:
        """A piece that lies in the sender's GPU memory, in the stream's order: its bytes copied
        device to device into arrays of this engine's own, on the device thread (a copy of a
        fraction of a millisecond: between two steps, not inside one), and written into the
        request's slot by that same job; kept for the install where it cannot be."""
        caller = self._callers.get(request_id)
        stage = None if caller is not None and caller.pieces else self._stage_command(
            request_id, segment, prompt_tokens, max_tokens)
        take = commands.TakeDevicePiece(piece, request_id, stage)
        built: list[Any] | None = await self._post(take, Local())
        if built is not None:
            piece_kept = (segment.first_layer, segment.end_layer, segment.start, built)
            self._callers.keep_piece(request_id, piece_kept)

    @staticmethod
    def _stage_command(request_id: RequestId, segment: KvSegment, prompt_tokens: int,
                       max_tokens: int) -> commands.StagePiece:
        return commands.StagePiece(request_id, segment.first_layer, segment.start, prompt_tokens,
                                   needed_tokens=prompt_tokens + max_tokens + 1)

    @staticmethod
    def _checked_device_piece(segment: KvSegment, fingerprint: str, classes: Sequence[str]) -> DevicePiece:
        """A device piece's document, checked here (framing, version, fingerprint, shapes)."""
        if not device_pieces_enabled():
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                           "a KV piece in GPU memory: this node reads none"))
        mine = classes[segment.first_layer : segment.end_layer]
        if len(segment.payload.pieces) != 1 or any(name != "KVCache" for name in mine):
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                           "a device piece for layers whose cache is not a plain KVCache"))
        return parse(segment.payload.pieces[0], fingerprint=fingerprint,
                     token_count=segment.stop - segment.start, layers=len(mine))

    async def _keep(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int,
                    max_tokens: int, built: list[Any], *, last: bool) -> None:
        """A checked piece into the request's slot as it comes (the install then copies nothing),
        else kept for the install: all of them once one could not be staged."""
        piece = (segment.first_layer, segment.end_layer, segment.start, built)
        caller = self._callers.get(request_id)
        if caller is None or not caller.pieces:
            if last and request_id in self._device.slots.staged:
                # The install job writes it: one wait for the device loop fewer before the join.
                self._callers.keep_piece(request_id, piece, last=True)
                return
            stage = self._stage_command(request_id, segment, prompt_tokens, max_tokens)
            staged: bool = await self._post(stage, Local(caches=built))
            if staged:
                return
        self._callers.keep_piece(request_id, piece)

