"""What the device loop and its lanes share: a request decoding (`Live`), as every lane holds it,
and what a lane needs of the loop that holds it (`LaneHost`: the model, the retry rule, the
delivery of tokens and endings), so that a lane module never imports the loop. MLX, mlx-lm and
trio only for the types it names; statecore and effects never import it.

A `Live` is in one lane at a time: the slot lane (`slot` set), the batch lane (`batched`), or the
solo lane (`solo_cache` set); in none while a choice of n > 1 waits for its siblings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio

from adapters.mlx.compiled import CompiledSlotStep
from adapters.mlx.jobs import StreamItem, StreamSend
from adapters.mlx.sampling import PositionSampler, SamplerMark
from adapters.mlx.slots import SlotPool
from effects.engine_port import GeneratedToken
from statecore.events import TokenLogprobs

__all__ = ["Deliveries", "LaneHost", "Live", "rewind"]

_T = TypeVar("_T")

Deliveries = dict[trio.lowlevel.TrioToken, list[Any]]
"""A step's stream items by the event loop they go to (one message per loop per step)."""


@dataclass(eq=False)
class Live:
    """A request in the decoder (see the module's paragraph)."""

    request_id: str
    send: StreamSend
    token: trio.lowlevel.TrioToken
    remaining: int  # tokens still to produce
    sampler: PositionSampler
    last_token: int
    slot: int | None = None
    offset: int = 0  # slot lane: positions in the slot's cache before the next input
    fed: bool = False  # slot lane: the first token went into a step (later inputs are on the device)
    staging: bool = False  # slot lane: its staged KV is still being written; out of the steps until then
    batched: bool = False  # a row of the batch lane
    solo_cache: list[Any] | None = None
    rejoin: bool = False  # solo for now: its batch's step kept raising; back to the batch lane after one step
    limit: int = 0  # the most positions its cache may reach (prompt + max_tokens): what it attends at most
    prompt_tokens: int = 0
    conversation: list[int] | None = None  # prompt and tokens so far, when it is kept at its end
    # A handed-off prompt whose whole chunks go into the prefix cache once its first step is read
    # back, not on the step it joins (`PrefixKeeping.keep_joined`): its tokens, and its cache outside
    # the slot lane (a slot row's is read from its slot then)
    keep_prompt: tuple[list[int], list[Any] | None] | None = None


class LaneHost(Protocol):
    """What a lane needs of the device loop that holds it (`adapters.mlx.device.DeviceLoop`)."""

    model: Any
    # (stage, the requests the next model call computes: one per row in its row order, "" for a row
    # computed for nothing; a verify step lists each once for its several rows): the test hook's,
    # and what tells per-request adapters their rows (lora_rows)
    computing: tuple[str, Sequence[str]]
    step_retries: int
    pool: SlotPool | None
    compiled: CompiledSlotStep | None
    bucket: int

    def twice(self, call: Callable[[], _T], undo: Callable[[], None], what: str) -> _T: ...

    def quantize(self, cache: list[Any]) -> None: ...

    def count_token(self, live: Live, token: int,
                    logprobs: TokenLogprobs | None = None) -> GeneratedToken: ...

    def hand_token(self, live: Live, item: GeneratedToken, deliveries: Deliveries) -> bool: ...

    def end(self, live: Live, item: StreamItem, deliveries: Deliveries) -> None: ...

    def fail_alone(self, live: Live, raised: Exception, deliveries: Deliveries) -> None: ...

    def hand_out(self, deliveries: Deliveries) -> None: ...


def rewind(rows: Sequence[Live], marks: Sequence[SamplerMark]) -> None:
    """Undo what a failed call's sampling advanced (each seeded draw takes the next position;
    a penalized row's recent tokens take the drawn one; a grammar consumed the one before)."""
    for live, mark in zip(rows, marks, strict=True):
        live.sampler.reset(mark)
