"""A request decoding on the device thread (`Live`), as every lane holds it. MLX and trio only
for the types it names; statecore and effects never import it.

A `Live` is in one lane at a time: the slot lane (`slot` set), the batch lane (`batched`), or the
solo lane (`solo_cache` set); in none while a choice of n > 1 waits for its siblings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import trio

from adapters.mlx.jobs import StreamItem
from adapters.mlx.sampling import PositionSampler, SamplerMark

__all__ = ["Live", "rewind"]


@dataclass(eq=False)
class Live:
    """A request in the decoder (see the module's paragraph)."""

    request_id: str
    send: trio.MemorySendChannel[StreamItem]
    token: trio.lowlevel.TrioToken
    remaining: int  # tokens still to produce
    sampler: PositionSampler
    last_token: int
    slot: int | None = None
    offset: int = 0  # slot lane: positions in the slot's cache before the next input
    fed: bool = False  # slot lane: the first token went into a step (later inputs are on the device)
    batched: bool = False  # a row of the batch lane
    solo_cache: list[Any] | None = None
    rejoin: bool = False  # solo for now: its batch's step kept raising; back to the batch lane after one step
    limit: int = 0  # the most positions its cache may reach (prompt + max_tokens): what it attends at most
    prompt_tokens: int = 0
    conversation: list[int] | None = None  # prompt and tokens so far, when it is kept at its end


def rewind(rows: Sequence[Live], marks: Sequence[SamplerMark]) -> None:
    """Undo what a failed call's sampling advanced (each seeded draw takes the next position;
    a penalized row's recent tokens take the drawn one; a grammar consumed the one before)."""
    for live, mark in zip(rows, marks, strict=True):
        live.sampler.reset(mark)
