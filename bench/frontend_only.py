"""The HTTP side of a single node alone: the real front end, runner and state machines over
`effects.fakes.FakeEngine` (tokens appear at once, ~1 ms apart per stream; no MLX work), so a load
generator measures how many tokens per second the serving path itself can stream.

    .venv/bin/python bench/frontend_only.py --port 18777 &
    .venv/bin/python bench/serve_bench.py --url http://127.0.0.1:18777 \
        --tokenizer src/adapters/demo_model --mix 128x128 --concurrency 32 --num-requests 320

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from adapters.openai_api import Frontend, build_app
from adapters.serve import demo_model_dir
from effects.backend import local_backend
from effects.fakes import FakeEngine
from effects.faults import Faults
from effects.interpret import EnginePerformer
from effects.runner import NodeRunner
from statecore.table import DECODE_REQUEST


async def serve_frontend(port: int) -> None:
    performer = EnginePerformer(FakeEngine(), None, Faults.parse([], "-no-marker-"))
    runner = NodeRunner(DECODE_REQUEST, performer, name="single")
    frontend = Frontend.load(demo_model_dir(), local_backend(runner, performer, max_live=4096))
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        await serve(build_app(frontend), config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=18777)
    args = parser.parse_args(argv)
    trio.run(serve_frontend, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
