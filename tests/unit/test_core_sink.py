"""The engine core's sink for a streamed prefill (`adapters.mlx.core_process.streamed_sink`): a piece
the device thread hands out after its prefill was cancelled must not end the core (it raised in
trio's callback, and the core died with every other request on the node: seen on an H100)."""

from __future__ import annotations

import math
from typing import Any

import trio

from adapters.mlx.core_process import streamed_sink
from adapters.mlx.core_wire import FirstToken
from effects.engine_port import KvPieces, KvSegment, PrefillOutcome


async def test_a_piece_after_the_prefill_ended_is_dropped_and_the_first_token_still_goes() -> None:
    pushed: list[Any] = []
    send, receive = trio.open_memory_channel[KvSegment](math.inf)
    sink = streamed_sink(7, pushed.append, send)
    piece = KvSegment(0, 4, 0, 2, KvPieces((b"x",)), False)
    sink(piece)
    assert receive.receive_nowait() is piece
    send.close()  # the prefill was cancelled: its call returned
    sink(piece)  # raised trio.ClosedResourceError before
    outcome = PrefillOutcome(first_token=5, prompt_tokens=4, held_bytes=0)
    sink(outcome)
    assert pushed == [FirstToken(7, outcome)]
