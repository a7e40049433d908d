"""`Backend`s built on a `NodeRunner`: what the OpenAI front end drives.

A single node (and a decode node serving its own short prompts) runs the decode request
machine and prefills locally; the router runs the router request machine over its peers.
Either way the front end sees one `Generation`: the runner's replies (`RespondToken`,
`Complete`, `Reject`) as the core made them. Admission is the runner's
(`statecore.policy.admission`); a stop string the front end matched reaches the core as the
`StopMatched` event (`effects.runner.RunnerGeneration.stop`). What the front end reads, stops
and gives up is told to the runner's instruments as it happens (metrics time tokens as the client
gets them).
This module may import `statecore` and trio; it must never import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from effects.faults import NO_FAULTS, FaultPort
from effects.interpret import EnginePerformer, NodeRequest, RoutedRequest, RouterPerformer
from effects.ports import GenerationRequest, ModelInfo
from effects.runner import NodeRunner, RunnerGeneration, open_generation
from statecore.errors import StatecoreError
from statecore.events import Admitted, Event, PrefillLocally
from statecore.policy import travel_refusal

# replies a request can produce beyond its tokens: a completion or a rejection, plus slack
_REPLY_SLACK = 4


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


__all__ = ["RunnerBackend", "local_backend", "router_backend"]
