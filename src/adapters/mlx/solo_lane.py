"""The solo lane: requests whose caches cannot batch (quantized KV, llama4's chunked cache,
custom classes), rows under a grammar outside the slot lane, and batch rows stepping alone for one
step after their batch's step kept raising (`Live.rejoin`): one generate_step-style call per
request and step, evaluated at once.

A step that raises is undone (`Checkpoint` of the request's caches, its sampler rewound) and
computed once more; if it raises again the request fails alone.
This module imports mlx and mlx_lm; it must never import trio (but for the types of `Live`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import generation_stream

from adapters.mlx.checkpoint import Checkpoint
from adapters.mlx.rows import Deliveries, LaneHost, Live
from adapters.mlx.sampling import read_logprobs

__all__ = ["SoloLane"]


class SoloLane:
    """The solo lane's steps (see the module's paragraph)."""

    def __init__(self, loop: LaneHost) -> None:
        self.loop = loop

    def step(self, rows: list[Live]) -> list[Live]:
        """One step of each of `rows` (the solo requests); those whose step after their batch's
        split is done and that go on, to rejoin the batch lane."""
        return [live for live in rows if self.step_one(live)]

    def step_one(self, live: Live) -> bool:
        """One step of a solo request; whether it rejoins the batch lane now."""
        loop = self.loop
        assert live.solo_cache is not None
        deliveries: Deliveries = {}
        loop.computing = ("decode", [live.request_id])
        checkpoint = Checkpoint(live.solo_cache)
        mark = live.sampler.mark()

        def undo() -> None:
            checkpoint.restore()
            live.sampler.reset(mark)

        try:
            token = loop.twice(lambda: self.call(live), undo, f"a solo decode step of {live.request_id}")
        except Exception as raised:
            loop.fail_alone(live, raised, deliveries)
            loop.hand_out(deliveries)
            return False
        live.last_token = token
        item = loop.count_token(live, token, read_logprobs(live.sampler.take_logprobs()))
        ended = loop.hand_token(live, item, deliveries)
        loop.hand_out(deliveries)
        return live.rejoin and not ended

    def call(self, live: Live) -> int:
        assert live.solo_cache is not None
        with mx.stream(generation_stream):
            logits = self.loop.model(mx.array([[live.last_token]]), cache=live.solo_cache)[:, -1, :]
            self.loop.quantize(live.solo_cache)
            sampled = live.sampler.next_token(logits)
            mx.eval(sampled, [c.state for c in live.solo_cache])
        return int(sampled.item())
