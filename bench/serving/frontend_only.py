"""The HTTP side of a single node alone: the real front end, runner and state machines over
`effects.fakes.FakeEngine` (tokens appear at once, ~1 ms apart per stream; no MLX work), so a load
generator measures how many tokens per second the serving path itself can stream. With
`--step-ms N` the fake decodes like a batched GPU engine instead, on its own clock: every N ms
each live stream gets its next token (those the HTTP side has not taken yet wait in its queue).

    .venv/bin/python bench/serving/frontend_only.py --port 18777 &
    .venv/bin/python bench/clients/serve_bench.py --url http://127.0.0.1:18777 \
        --tokenizer src/adapters/demo_model --mix 128x128 --concurrency 32 --num-requests 320

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from adapters.serve.flags import demo_model_dir
from effects.engine_port import Decoded
from effects.fakes import FakeEngine
from effects.faults import Faults
from effects.interpret import EnginePerformer, local_backend
from effects.runner import NodeRunner
from statecore.ids import RequestId
from statecore.policy import decoded
from statecore.table import DECODE_REQUEST


class SteppedEngine(FakeEngine):
    """`FakeEngine` as a device on its own clock: every `step_s` each live stream gets one more
    token (a decode step of the whole batch). When the event loop falls behind, the steps it
    missed still happened: their tokens come at once and wait in the request's queue, as a GPU's
    would while the HTTP side catches up."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s
        self.steps = 0  # decode steps done since start
        self._tick = trio.Event()

    async def run_steps(self) -> None:
        start = trio.current_time()
        while True:
            await trio.sleep_until(start + (self.steps + 1) * self.step_s)
            self.steps = int((trio.current_time() - start) / self.step_s)
            tick, self._tick = self._tick, trio.Event()
            tick.set()

    async def stream(self, request_id: RequestId) -> AsyncIterator[Decoded]:
        receive = self._streams.get(request_id)
        if receive is None:
            return
        step = self.steps  # the step this stream's next token comes from
        async with receive:
            async for tokens in receive:  # a step's (one token each: `step_tokens` 1)
                while self.steps <= step:
                    await self._tick.wait()
                step += 1
                if tokens[-1].finish_reason is not None:
                    self.decoding.pop(request_id, None)
                    self._streams.pop(request_id, None)
                for event in decoded(tokens):
                    yield event


async def serve_frontend(port: int, step_ms: float | None) -> None:
    engine = FakeEngine() if step_ms is None else SteppedEngine(step_ms / 1000)
    performer = EnginePerformer(engine, None, Faults.parse([], "-no-marker-"))
    runner = NodeRunner(DECODE_REQUEST, performer, name="single")
    frontend = Frontend.load(demo_model_dir(), local_backend(runner, performer, max_live=4096))
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        if isinstance(engine, SteppedEngine):
            nursery.start_soon(engine.run_steps)
        await nursery.start(runner.run)
        await serve(build_app(frontend), config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=18777)
    parser.add_argument("--step-ms", type=float, default=None,
                        help="decode in steps of this many ms on a clock of its own, all streams "
                             "together (default: each stream on its own, ~1 ms a token)")
    args = parser.parse_args(argv)
    trio.run(serve_frontend, args.port, args.step_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
