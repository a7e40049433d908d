"""Opening and closing a real `MlxEngine` in a test, each under a deadline: a tiny model loads
and closes in seconds, so an engine that hangs (a device thread that never answers) fails its
test here, at once and saying so, instead of running into the per-test timeout. Also a test's
set of engines closed at its end, one request served whole with what a parity check compares, and
an engine's stream read as the tokens it sends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from adapters.mlx import MlxEngine
from effects.engine_port import Decoded, Engine, KvSegment, PrefillOutcome, SamplingParams
from statecore.events import Finished, TokenLogprobs, TokensGenerated
from statecore.ids import RequestId

ENGINE_DEADLINE_S = 120.0  # generous: a loaded 2-core machine compiles and loads slowly


@dataclass
class Streamed:
    """What an engine's stream sent after the first token: its tokens in order (an ending EOS is
    not sent), each one's logprobs (None where not asked), and how it ended (None: it never said)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish: str | None = None
    steps: int = 0  # the values its tokens came in


async def streamed(stream: AsyncIterator[Decoded]) -> Streamed:
    """Read an engine's stream to its end; nothing comes after its `Finished`."""
    seen = Streamed()
    async for event in stream:
        assert seen.finish is None, f"{event} after the stream's end"
        match event:
            case TokensGenerated(tokens=tokens, logprobs=logprobs):
                assert tokens and (logprobs is None or len(logprobs) == len(tokens)), event
                seen.tokens += tokens
                seen.logprobs += logprobs if logprobs is not None else [None] * len(tokens)
                seen.steps += 1
            case Finished(finish_reason=reason):
                seen.finish = reason
    return seen


async def sent_tokens(stream: AsyncIterator[Decoded]) -> list[int]:
    """The tokens an engine's stream sends after the first one."""
    return (await streamed(stream)).tokens


async def load_engine(model_dir: Path, **kw: Any) -> MlxEngine:
    with trio.fail_after(ENGINE_DEADLINE_S):
        return await MlxEngine.load(model_dir, **kw)


async def close_engine(engine: MlxEngine) -> None:
    with trio.fail_after(ENGINE_DEADLINE_S):
        await engine.aclose()


@asynccontextmanager
async def opened_engines() -> AsyncIterator[list[MlxEngine]]:
    """A list to append a test's engines to (`load_into`); each is closed on the way out."""
    opened: list[MlxEngine] = []
    try:
        yield opened
    finally:
        for engine in opened:
            await close_engine(engine)


async def load_into(opened: list[MlxEngine], model_dir: Path, **kw: Any) -> MlxEngine:
    engine = await load_engine(model_dir, **kw)
    opened.append(engine)
    return engine


async def served_whole(engine: Engine, rid: str, prompt: Sequence[int], sampling: SamplingParams
                       ) -> tuple[int, int, bytes, list[int]]:
    """(first token, cached tokens, the held KV's wire bytes, every token) of one request, prefilled
    and decoded on `engine`."""
    outcome = await engine.prefill(RequestId(rid), prompt, sampling)
    held = (await engine.export_held(RequestId(rid))).joined()
    await engine.decode_held(RequestId(rid), prompt, outcome.first_token, sampling)
    tokens = [outcome.first_token] + await sent_tokens(engine.stream(RequestId(rid)))
    return outcome.first_token, outcome.cached_tokens, held, tokens


async def streamed_prefill(engine: Engine, rid: RequestId, prompt: Sequence[int], sampling: SamplingParams
                           ) -> tuple[PrefillOutcome, list[KvSegment]]:
    """A prefill whose pieces stream to a sink: its outcome and pieces, checked to have told the
    first token once, ahead of the last piece (the step that sampled it hands its pieces after),
    as the outcome the prefill returns."""
    items: list[KvSegment | PrefillOutcome] = []
    outcome = await engine.prefill(rid, prompt, sampling, segments=items.append)
    told = [index for index, item in enumerate(items) if isinstance(item, PrefillOutcome)]
    pieces = [item for item in items if isinstance(item, KvSegment)]
    if pieces and outcome.streamed:
        assert len(told) == 1 and items[told[0]] == outcome, items
        assert told[0] < len(items) - 1, "the first token came after the last piece"
    return outcome, pieces
