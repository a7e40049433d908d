"""`Backend`s built on a `NodeRunner`: what the OpenAI front end drives.

A single node (and a decode node serving its own short prompts) runs the decode request
machine and prefills locally; the router runs the router request machine over its peers.
Either way the front end sees one `Generation`: the runner's replies (`RespondToken`,
`Complete`, `Reject`) as the core made them. Admission is the runner's
(`statecore.policy.admission`); a stop string the front end matched reaches the core as the
`StopMatched` event (`RunnerGeneration.stop`). What the front end reads, stops and gives up is
told to the runner's instruments as it happens (metrics time tokens as the client gets them).
This module may import `statecore` and trio; it must never import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, assert_never

import trio

from effects.faults import NO_FAULTS, FaultPort, Phase
from effects.interpret import EnginePerformer, NodeRequest, RoutedRequest, RouterPerformer
from effects.ports import GenerationRequest, ModelInfo, Output
from effects.runner import NodeRunner, Reply
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.events import Admitted, ClientCancelled, Event, PrefillLocally, StopMatched
from statecore.ids import RequestId
from statecore.intents import Complete, Reject, RespondToken
from statecore.policy import travel_refusal

# replies a request can produce beyond its tokens: a completion or a rejection, plus slack
_REPLY_SLACK = 4


class RunnerGeneration:
    def __init__(
        self,
        runner: NodeRunner[Any],
        request_id: RequestId,
        replies: trio.MemoryReceiveChannel[Reply],
        context: NodeRequest | RoutedRequest | None = None,
    ) -> None:
        self.runner = runner
        self.request_id = request_id
        self.replies = replies
        # the role's context for the request (its prefill's cached tokens): held here too, since
        # the runner drops its entry when the request ends, maybe before this is read
        self.context = context
        self._ended = False  # the last output (an end or an error) was given

    @property
    def cached_tokens(self) -> int:
        return 0 if self.context is None else self.context.cached_tokens

    async def __aiter__(self) -> AsyncIterator[Output]:
        async with self.replies:
            while not self._ended:
                try:
                    reply = await self.replies.receive()
                except trio.EndOfChannel:
                    yield self._unfinished()
                    return
                yield self._output(reply)

    def receive_nowait(self) -> Output | None:
        if self._ended:
            return None
        try:
            reply = self.replies.receive_nowait()
        except trio.WouldBlock:
            return None
        except trio.EndOfChannel:
            return self._unfinished()
        return self._output(reply)

    def _output(self, reply: Reply) -> Output:
        self.runner.instruments.reply_read(self.request_id, reply)
        match reply:
            case RespondToken():
                pass
            case Complete() | Reject():
                self._end()
            case _:
                assert_never(reply)
        return reply

    def _unfinished(self) -> Output:
        return self._output(Reject(self.request_id, ErrorInfo(
            Fault.BUG, Code.INTERNAL, "the request ended without a completion")))

    def _end(self) -> None:
        self._ended = True
        self.replies.close()  # nothing more is read; also when the iterator is never resumed

    async def stop(self) -> None:
        self.runner.instruments.generation_stopped(self.request_id)
        await self.runner.post(self.request_id, StopMatched())

    async def cancel(self) -> None:
        self.runner.instruments.generation_cancelled(self.request_id)
        await self.runner.post(self.request_id, ClientCancelled())


async def open_generation(
    runner: NodeRunner[Any],
    request_id: RequestId,
    capacity: int,
    context: NodeRequest | RoutedRequest,
    *,
    max_live: int | None,
    faults: FaultPort,
    refusal: ErrorInfo | None = None,
) -> RunnerGeneration:
    """The one door into a runner, for the front end's backend and the node API alike: the
    loop's admission (`statecore.policy.admission`, `max_live` requests in flight at most), then
    the caller's own `refusal` if it has one (a node whose engine is lost), then the request is
    opened with room for `capacity` replies. A refusal raises StatecoreError."""
    refused = runner.admission_error(max_live) or refusal
    if refused is not None:
        raise StatecoreError(refused)
    await faults.at(Phase.INTAKE, request_id)
    replies = await runner.open(request_id, capacity, context)
    return RunnerGeneration(runner, request_id, replies, context)


class RunnerBackend:
    """A `Backend` whose requests live in a `NodeRunner`."""

    def __init__(
        self,
        runner: NodeRunner[Any],
        model_info: Callable[[], ModelInfo],
        admit: Callable[[GenerationRequest], tuple[Event, NodeRequest | RoutedRequest]],
        *,
        max_live: int = 256,
        faults: FaultPort = NO_FAULTS,
    ) -> None:
        self.runner = runner
        self._model_info = model_info
        self._admit = admit
        self.max_live = max_live
        self.faults = faults

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info()

    def ready(self) -> bool:
        return self.runner.ready()

    async def start(self, request: GenerationRequest) -> RunnerGeneration:
        try:
            first_event, context = self._admit(request)
            generation = await open_generation(self.runner, request.request_id,
                                               request.sampling.max_tokens + _REPLY_SLACK, context,
                                               max_live=self.max_live, faults=self.faults)
        except StatecoreError as exc:
            self.runner.instruments.generation_refused(exc.info)
            raise
        self.runner.instruments.generation_started(request.request_id, len(request.prompt))
        await self.runner.post(request.request_id, first_event)
        return generation


def local_backend(
    runner: NodeRunner[Any], performer: EnginePerformer, *, max_live: int = 256
) -> RunnerBackend:
    """A single node: every request prefills and decodes here."""

    def admit(request: GenerationRequest) -> tuple[Event, NodeRequest]:
        return PrefillLocally(), NodeRequest(request.prompt, request.sampling)

    return RunnerBackend(
        runner, lambda: performer.engine.info, admit, max_live=max_live, faults=performer.faults
    )


def router_backend(
    runner: NodeRunner[Any],
    performer: RouterPerformer,
    model_info: Callable[[], ModelInfo],
    *,
    local_prefill_below: int,
    max_live: int = 256,
    faults: FaultPort = NO_FAULTS,
) -> RunnerBackend:
    """The router: short prompts prefill on the decode node, long ones on a prefill node.

    A model whose cache cannot travel is refused at intake for every request that would
    need a handoff, with a typed error naming the class — never mid-stream."""
    def admit(request: GenerationRequest) -> tuple[Event, RoutedRequest]:
        info = model_info()
        refused = travel_refusal(len(request.prompt), local_prefill_below, can_travel=info.can_travel,
                                 untravelable_classes=info.untravelable_classes)
        if refused is not None:
            raise StatecoreError(refused)
        # where it prefills is decided per attempt, by the route (RouterPerformer._start)
        return Admitted(len(request.prompt)), RoutedRequest(request.prompt, request.sampling)

    return RunnerBackend(runner, model_info, admit, max_live=max_live, faults=faults)


__all__ = ["RunnerBackend", "RunnerGeneration", "local_backend", "open_generation", "router_backend"]
