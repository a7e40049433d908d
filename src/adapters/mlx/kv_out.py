"""KV leaving this node as wire pieces: a held cache's export, the prefix cache's blocks, and a
streamed prefill's pieces as each step computes them.

The device thread copies a cache's tensors to host memory (`adapters.kv.codec.host_tensors`);
`pieces_of` frames them as a KV wire payload over that very memory (no copy into one body) with
its end frame's checksum computed in a background thread while the pieces already travel.
`segment_sink` is what a streamed prefill hands each computed piece to, on the device thread: the
piece framed so, posted to its caller's `SegmentSink` in trio. This module imports mlx-lm (a
piece's caches) and trio (the post); statecore and effects never import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from adapters.kv import codec, frames
from adapters.mlx.jobs import post
from effects.engine_port import KvPieces, KvSegment, SegmentSink

__all__ = ["pieces_of", "segment_sink"]


def pieces_of(tensors: frames.HostTensors) -> KvPieces:
    """A payload over the tensors' own memory; its end frame computed on its own thread."""
    return KvPieces(tuple(frames.unsealed_pieces(tensors)), seal=frames.end_frame_in_background(tensors),
                    seal_nbytes=frames.END_FRAME_BYTES)


def segment_sink(segments: SegmentSink, trio_token: trio.lowlevel.TrioToken, fingerprint: str
                 ) -> Callable[[tuple[int, int, int, int], list[Any], Any, bool], None]:
    """On the device thread: a computed piece (its range; keys then values of each of its
    layers, evaluated as `codec.wire_view` made them; their dtype; whether the prompt's last step
    has started) framed as a wire payload over its own host memory, handed to `segments` in
    trio. Nothing is evaluated here: the device thread goes on to the next step at once."""

    def hand(where: tuple[int, int, int, int], arrays: list[Any], dtype: Any, last_step_started: bool
             ) -> None:
        start, stop, first_layer, end_layer = where
        tensors = codec.kv_piece_tensors(arrays, dtype=dtype, fingerprint=fingerprint,
                                         token_count=stop - start)
        post(trio_token, segments, KvSegment(start, stop, first_layer, end_layer, pieces_of(tensors),
                                             last_step_started))

    return hand
