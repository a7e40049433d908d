"""KV leaving this node as wire pieces: a held cache's export, the prefix cache's blocks, and a
streamed prefill's pieces as each step computes them.

The device thread copies a cache's tensors to host memory (`adapters.kv.codec.host_tensors`);
`pieces_of` frames them as a KV wire payload over that very memory (no copy into one body) with
its end frame's checksum computed in a background thread while the pieces already travel.
`segment_sink` is what a streamed prefill hands each computed piece to, on the device thread: the
piece framed so, posted to its caller's `SegmentSink` in trio, and its first token ahead of the
last step's pieces. This module imports mlx-lm (a
piece's caches) and trio (the post); statecore and effects never import it.
"""

from __future__ import annotations

from typing import Any

import trio

from adapters.kv import codec, frames
from adapters.mlx.jobs import post
from effects.engine_port import KvPieces, KvSegment, PrefillOutcome, SegmentSink

__all__ = ["PieceHandout", "pieces_of", "segment_sink"]


def pieces_of(tensors: frames.HostTensors) -> KvPieces:
    """A payload over the tensors' own memory; its end frame computed on its own thread."""
    return KvPieces(tuple(frames.unsealed_pieces(tensors)), seal=frames.end_frame_in_background(tensors),
                    seal_nbytes=frames.END_FRAME_BYTES)


class PieceHandout:
    """On the device thread: what a streamed prefill hands its caller in trio, in order. A piece
    (`__call__`: its range; keys then values of each of its layers, evaluated as `codec.wire_view`
    made them; their dtype; whether the prompt's last step has started) framed as a wire payload
    over its own host memory; the outcome (`first_token`) as soon as the first token is read
    back, ahead of the pieces of the step that sampled it. Nothing is evaluated here: the device
    thread goes on to the next step at once."""

    def __init__(self, segments: SegmentSink, trio_token: trio.lowlevel.TrioToken, fingerprint: str) -> None:
        self._segments = segments
        self._trio_token = trio_token
        self._fingerprint = fingerprint

    def __call__(self, where: tuple[int, int, int, int], arrays: list[Any], dtype: Any,
                 last_step_started: bool) -> None:
        start, stop, first_layer, end_layer = where
        tensors = codec.kv_piece_tensors(arrays, dtype=dtype, fingerprint=self._fingerprint,
                                         token_count=stop - start)
        post(self._trio_token, self._segments, KvSegment(start, stop, first_layer, end_layer,
                                                         pieces_of(tensors), last_step_started))

    def first_token(self, outcome: PrefillOutcome) -> None:
        post(self._trio_token, self._segments, outcome)


def segment_sink(segments: SegmentSink, trio_token: trio.lowlevel.TrioToken, fingerprint: str
                 ) -> PieceHandout:
    """A streamed prefill's sink on the device thread, handing to `segments` in trio."""
    return PieceHandout(segments, trio_token, fingerprint)
