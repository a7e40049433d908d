"""KV leaving this node as wire pieces: a held cache's export, the prefix cache's blocks, and a
streamed prefill's pieces as each step computes them.

The device thread copies a cache's tensors to host memory (`adapters.kv.codec.host_tensors`);
`pieces_of` frames them as a KV wire payload over that very memory (no copy into one body) with
its end frame's checksum computed in a background thread while the pieces already travel.
On the device thread, for a streamed prefill: `capture_pieces` cuts the KV a step completes out
as its own arrays (evaluated with the step); at read-back `tell_first_tokens` gives a finished
prompt's outcome to its sink first, then `hand_pieces` the step's pieces; `segment_sink` is that
sink, each piece framed so (or, where its receiver reads this host's GPU memory, copied device to
device and sent as a device piece document: `adapters.mlx.device_pieces`) and posted to its
caller's `SegmentSink` in trio. This module imports mlx (a piece's arrays) and trio (the post);
statecore and effects never import it.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import trio

from adapters.kv import codec, frames
from adapters.kv.codec import wire_view
from adapters.mlx import device_pieces, managed_memory
from adapters.mlx.jobs import post
from adapters.mlx.prefill import PrefillTask
from effects.engine_port import KvPieces, KvSegment, PrefillOutcome, SegmentSink
from statecore.scheduling import DEVICE_PIECE_BYTES, STREAMED_PIECE_BYTES, streamed_pieces

__all__ = ["Captured", "PieceHandout", "Range", "capture_pieces", "hand_pieces", "pieces_of", "segment_sink",
           "tell_first_tokens"]

logger = logging.getLogger("adapters.engine_mlx")

Range = tuple[int, int, int, int]  # a piece's tokens [start, stop) of layers [first, end)
# a step's captured pieces: (their prompt, where, keys then values per layer as the wire carries
# them (`codec.wire_view`), their dtype)
Captured = list[tuple[PrefillTask, Range, list[Any], Any]]


def pieces_of(tensors: frames.HostTensors) -> KvPieces:
    """A payload over the tensors' own memory; its end frame computed on its own thread."""
    return KvPieces(tuple(frames.unsealed_pieces(tensors)), seal=frames.end_frame_in_background(tensors),
                    seal_nbytes=frames.END_FRAME_BYTES)


class PieceHandout:
    """On the device thread: what a streamed prefill hands its caller in trio, in order. A piece
    (`__call__`: its range; keys then values of each of its layers, evaluated as `codec.wire_view`
    made them; their dtype; whether the prompt's last step has started) framed as a wire payload
    over its own host memory, or copied into the device arena (`arena`: a copy between device
    buffers, the step's arrays being computed by now); the outcome (`first_token`) as soon as the
    first token is read back, ahead of the pieces of the step that sampled it. Nothing new is
    computed here: the device thread goes on to the next step at once."""

    def __init__(self, segments: SegmentSink, trio_token: trio.lowlevel.TrioToken, fingerprint: str,
                 request_id: str, arena: device_pieces.DeviceArena | None) -> None:
        self._segments = segments
        self._trio_token = trio_token
        self._fingerprint = fingerprint
        self._request_id = request_id
        self._arena = arena  # the receiver takes pieces in GPU memory: they go device to device

    def __call__(self, where: tuple[int, int, int, int], arrays: list[Any], dtype: Any,
                 last_step_started: bool) -> None:
        start, stop, first_layer, end_layer = where
        payload = self._on_device(arrays, dtype, stop - start)
        if payload is None:
            # on CUDA with `copy`, the copy engine's copies in host memory, read from here on
            arrays = managed_memory.host_copies(arrays)
            tensors = codec.kv_piece_tensors(arrays, dtype=dtype, fingerprint=self._fingerprint,
                                             token_count=stop - start)
            payload = pieces_of(tensors)
        post(self._trio_token, self._segments, KvSegment(start, stop, first_layer, end_layer, payload,
                                                         last_step_started))

    def most_piece_bytes(self) -> int:
        """How large a piece this sink takes: a whole step's KV while pieces stay in GPU memory."""
        return DEVICE_PIECE_BYTES if self._arena is not None else STREAMED_PIECE_BYTES

    def on_device(self) -> bool:
        """From the next piece on, pieces stay in GPU memory (the receiver said so after the
        prefill began: a streamed handoff the router started); False where they cannot. Called
        from trio: the device thread reads `_arena` once per piece, either value is whole."""
        if self._arena is None:
            self._arena = device_pieces.arena()
        return self._arena is not None

    def _on_device(self, arrays: list[Any], dtype: Any, token_count: int) -> KvPieces | None:
        """The piece as a device piece document, its arrays copied into the arena (computed with
        their step: this only waits for it); None when it goes the host's way."""
        name = device_pieces.dtype_name(dtype)
        if self._arena is None or name is None:
            return None
        mx.eval(*arrays)
        document = self._arena.put(self._request_id, arrays, dtype=name, fingerprint=self._fingerprint,
                                   token_count=token_count)
        return None if document is None else KvPieces((document,))

    def first_token(self, outcome: PrefillOutcome) -> None:
        post(self._trio_token, self._segments, outcome)


def segment_sink(segments: SegmentSink, trio_token: trio.lowlevel.TrioToken, fingerprint: str,
                 request_id: str, *, device: bool = False) -> PieceHandout:
    """A streamed prefill's sink on the device thread, handing to `segments` in trio (`device`:
    its pieces may stay in GPU memory, `adapters.mlx.device_pieces`)."""
    return PieceHandout(segments, trio_token, fingerprint, request_id,
                        device_pieces.arena() if device else None)


def capture_pieces(task: PrefillTask, captured: Captured, streamed_from: dict[str, int]) -> list[Any]:
    """A streamed handoff's pieces whose KV this step completes: per chunk, the layers of the
    units built since the last capture, cut out as their own arrays (evaluated with the step,
    handed to the sink when it is read back), in pieces of at most the sink's
    `most_piece_bytes` (`statecore.scheduling.streamed_pieces`). Cached leading chunks go in the
    first capture.
    `streamed_from` notes the first unit this step streams (a failed step's are sent again)."""
    if task.segment_sink is None or task.cache is None or task.streamed_units >= task.done_units:
        return []
    arrays: list[Any] = []
    units = task.units[task.streamed_units : task.done_units]
    ranges: list[Range] = []
    for chunk in sorted({unit.chunk for unit in units}):
        mine = [unit for unit in units if unit.chunk == chunk]
        first, end = mine[0].first_layer, mine[-1].end_layer
        if first == end:
            continue  # units inside a layer only (`PrefillUnit.inner`): no layer's KV is complete
        start = task.chunk_start(chunk)
        stop = start + task.chunks[chunk]
        if ranges and ranges[-1][1] == start and ranges[-1][2:] == (first, end):
            start = ranges.pop()[0]  # the chunks of one step go as one piece when they can
        ranges.append((start, stop, first, end))
    keys, values = task.cache[0].keys, task.cache[0].values
    layer_token_bytes = (keys.shape[1] * keys.shape[3] * keys.dtype.size
                         + values.shape[1] * values.shape[3] * values.dtype.size)
    for where in [piece for step_range in ranges
                  for piece in streamed_pieces(*step_range, layer_token_bytes=layer_token_bytes,
                                               most_bytes=task.segment_sink.most_piece_bytes())]:
        start, stop, first, end = where
        pieces = [wire_view(mx.contiguous(buffer[..., start:stop, :])) for layer in task.cache[first:end]
                  for buffer in (layer.keys, layer.values)]
        captured.append((task, where, pieces, keys.dtype))
        arrays.extend(pieces)
    streamed_from.setdefault(task.request_id, task.streamed_units)
    task.streamed_units = task.done_units
    return arrays


def tell_first_tokens(finished: list[PrefillTask], outcomes: list[PrefillOutcome]) -> None:
    """A streamed prompt's first token to its sink ahead of the pieces of the step that sampled
    it: reading those pieces out waits for the device (on a GPU each one is copied to the host),
    and its caller passes the first token on at once."""
    for task, outcome in zip(finished, outcomes, strict=True):
        if task.segment_sink is None or task.job is None or task.job.is_abandoned():
            continue
        try:
            task.segment_sink.first_token(outcome)
        except Exception:  # the sink's failure is its request's (it hears of it at export)
            logger.exception("telling %s's first token failed", task.request_id)
            task.segment_sink = None


def hand_pieces(captured: Captured, finished: list[PrefillTask]) -> None:
    """A read-back step's streamed pieces to their sinks (computed now), unless the request left
    meanwhile. A piece says whether the step computing its prompt's last pieces has started: the
    next step was built before this one is read back, so a prompt whose units are all built, and
    which this step did not finish (`finished`), finishes in the step now running."""
    # On CUDA the host reads them next (a copy into shared memory, their checksum): their pages
    # move to it in bulk now rather than by faults in the readers (`managed_memory`).
    managed_memory.to_host([array for _, _, pieces, _ in captured for array in pieces])
    for task, where, pieces, dtype in captured:
        if task.job is None or task.job.is_abandoned():
            continue
        last_step_started = task.done_units >= len(task.units) and task not in finished
        try:
            task.segment_sink(where, pieces, dtype, last_step_started)
        except Exception:  # the sink's failure is its request's (it hears of it at export)
            logger.exception("handing a KV segment of %s out failed", task.request_id)
            task.segment_sink = None
