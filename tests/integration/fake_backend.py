"""A scripted in-memory `Backend` for front-end tests: each generation yields a given script.

A script is a list of outputs (the core's replies: `replied`, `completed` and `rejected` write them under
`SCRIPTED`, and a generation plays them as its own request's), exceptions to raise from the
iterator, and `HANG` (block until the front end stops or cancels the generation). The
fake records every request, stop and cancel so tests can assert on them. Outputs not behind an
exception or `HANG` are "already waiting" (`receive_nowait`) unless `ready_ahead` is turned off.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Final

import trio

from effects.ports import GenerationRequest, ModelInfo, Output
from statecore.errors import ErrorInfo
from statecore.events import TokenLogprobs
from statecore.ids import RequestId
from statecore.intents import Complete, Reject, RespondTokens
from statecore.policy import counts_ending_token

__all__ = ["HANG", "SCRIPTED", "FakeBackend", "FakeGeneration", "ScriptItem", "as_scripted", "completed",
           "fake_model_info", "rejected", "replied"]

SCRIPTED = RequestId("scripted")
"""The request a script's outputs name: a generation plays them as its own request's."""


def replied(t: int, logprobs: TokenLogprobs | None = None) -> RespondTokens:
    return RespondTokens(SCRIPTED, (t,), None if logprobs is None else (logprobs,))


def completed(reason: str) -> Complete:
    """The end the core would send (an ending EOS counted as it counts it)."""
    return Complete(SCRIPTED, reason, int(counts_ending_token(reason)))


def rejected(error: ErrorInfo) -> Reject:
    return Reject(SCRIPTED, error)


def as_scripted(output: Output) -> Output:
    """An output as a script writes it (under `SCRIPTED`), to compare with one."""
    return replace(output, request_id=SCRIPTED)


class _Hang:
    def __repr__(self) -> str:
        return "HANG"


HANG: Final = _Hang()
ScriptItem = Output | BaseException | _Hang


def fake_model_info(
    *, name: str = "tiny", context_length: int = 64, vocab_size: int = 512, eos: int = 1
) -> ModelInfo:
    return ModelInfo(
        name=name,
        fingerprint="fake",
        context_length=context_length,
        vocab_size=vocab_size,
        eos_token_ids=frozenset({eos}),
        prefill_chunk_size=32,
    )


class FakeGeneration:
    """Plays its script. With `ready_ahead` the outputs up to the next exception or `HANG` count
    as already waiting (`receive_nowait` takes them), as tokens queued by a busy engine are."""

    def __init__(self, request: GenerationRequest, script: Sequence[ScriptItem],
                 *, ready_ahead: bool = True) -> None:
        self.request = request
        self.script = tuple(script)
        self.ready_ahead = ready_ahead
        self.stops = 0
        self.cancels = 0
        self.yielded = 0
        self.taken_nowait = 0  # of `yielded`, the outputs `receive_nowait` gave
        self.cached_tokens = 0  # what the prefill would have taken from a prefix cache
        self._next = 0
        self._closed = trio.Event()

    def __aiter__(self) -> AsyncIterator[Output]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[Output]:
        while self._next < len(self.script):
            if self._closed.is_set():
                return
            item = self.script[self._next]
            self._next += 1
            if isinstance(item, _Hang):
                await self._closed.wait()
                return
            if isinstance(item, BaseException):
                raise item
            await trio.lowlevel.checkpoint()
            self.yielded += 1
            yield replace(item, request_id=self.request.request_id)

    def receive_nowait(self) -> Output | None:
        if not self.ready_ahead or self._closed.is_set() or self._next >= len(self.script):
            return None
        item = self.script[self._next]
        if isinstance(item, _Hang | BaseException):
            return None
        self._next += 1
        self.yielded += 1
        self.taken_nowait += 1
        return replace(item, request_id=self.request.request_id)

    async def stop(self) -> None:
        self.stops += 1
        self._closed.set()

    async def cancel(self) -> None:
        self.cancels += 1
        self._closed.set()


class FakeBackend:
    """Hands out generations that play `scripts` in order, then `default_script` forever."""

    def __init__(self, info: ModelInfo | None = None, *, ready: bool = True) -> None:
        self.info = info if info is not None else fake_model_info()
        self.is_ready = ready
        self.scripts: deque[Sequence[ScriptItem]] = deque()
        self.default_script: Sequence[ScriptItem] = ()
        self.start_error: BaseException | None = None
        self.ready_ahead = True  # generations' queued outputs can be taken without waiting
        self.generations: list[FakeGeneration] = []

    @property
    def model_info(self) -> ModelInfo:
        return self.info

    def ready(self) -> bool:
        return self.is_ready

    async def start(self, request: GenerationRequest) -> FakeGeneration:
        await trio.lowlevel.checkpoint()
        if self.start_error is not None:
            raise self.start_error
        script = self.scripts.popleft() if self.scripts else self.default_script
        generation = FakeGeneration(request, script, ready_ahead=self.ready_ahead)
        self.generations.append(generation)
        return generation

    @property
    def last(self) -> FakeGeneration:
        return self.generations[-1]
