"""Role performers: how each role carries out the core's work intents through ports.

`EnginePerformer` serves prefill, decode and single nodes through the `Engine` port (and `Peers`
to pull KV from a prefill node, or read its stream: `StreamReceiver`); `RouterPerformer` serves
the router through `Peers` alone. Each request's context (prompt, sampling, chosen nodes) lives
in the runner's entry for it and is handed to every call; the performer keeps no map of its own.
How a generation ends and what a peer's failure means are `statecore.policy`'s answers; fault
injection is the `FaultPort` (never asked in production: not armed). Outcomes come back as
events; a StatecoreError raised here fails only its own request. The front end's backend over
each role's runner is made here too (`local_backend`, `router_backend`: how a generation is
admitted, the role's context for it). This module may import `statecore` and trio; it must never
import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from effects.faults import NO_FAULTS, FaultPort, Phase
from effects.handoffs import HandoffLog, HandoffRecord
from effects.kv_pulls import KvPulls, KvStreams
from effects.ports import (
    DecodeCall,
    DecodeMessage,
    Engine,
    GenerationRequest,
    KvBytes,
    KvSegment,
    ModelInfo,
    Peers,
    PrefillOutcome,
    PrefillReply,
    PrefixSource,
    SamplingParams,
    SegmentSink,
)
from effects.prefix_pull import PrefixPuller
from effects.runner import Answer, CleanupIntent, NodeRunner, Post, RunnerBackend, WorkIntent
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, bug
from statecore.events import (
    Admitted,
    Dispatched,
    Event,
    Finished,
    FirstToken,
    KvInstalled,
    KvReceived,
    PrefillDone,
    PrefillLocally,
    RetryRequested,
    TokensGenerated,
)
from statecore.ids import RequestId
from statecore.intents import (
    CancelRemote,
    FetchKv,
    InstallKv,
    ReleaseKv,
    SendKv,
    StartDecode,
    StartPrefill,
    StopDecoding,
)
from statecore.policy import (
    RetryState,
    after_first_token,
    attempt_failed,
    blames_peer,
    first_token_ends,
    first_token_finish,
    travel_refusal,
)
from statecore.routing import Route, RouteChoice, avoiding

log = logging.getLogger("statecore.interpret")


@dataclass(slots=True)
class NodeRequest:
    """What an engine-backed node keeps for one request."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    first_token: int | None = None
    # whether the first token ends the request (EOS: `statecore.policy.first_token_ends`), decided
    # once, where the first token is known: by its prefill here, else by the prefill node's reply
    ends_at_first_token: bool = False
    prefill_url: str | None = None  # pull the KV from here; None: the cache is local
    hands_off: bool = False  # a prefill node's request: the cache leaves, whatever the token
    device_pieces: bool = False  # a prefill node's streamed request: its receiver reads GPU memory here
    # a prefill node's stream the router started: the decode node that will attach, as the router names it
    attach_by: str | None = None
    payload: KvBytes | None = None  # a view of a receive buffer: dropped once installed
    # a decode node's streamed handoff: the KV comes as a stream that this node opens itself (to
    # `prefill_url`, which then computes the prompt); a prefill node's stream is `KvStreams`'s
    streamed: bool = False
    kv_attach: bool = False  # a streamed handoff whose prefill the router started: attach to it
    # a streamed handoff read to its end: how many pieces went to the engine (an install asked
    # while the last are still checked waits for them: `Engine.install_segments`)
    kv_pieces: int | None = None
    first_token_at: float | None = None  # decode: when a streamed handoff's first token was passed on
    cached_tokens: int = 0  # of the prompt, taken from the prefix cache by the prefill here
    prefix_from: PrefixSource | None = None  # a prefill node's hint: the decode node holds the start
    # Its clock on this node (what the metrics read and stamp: the node keeps no other map of
    # its requests' times): when it came in, and its latest token out.
    opened_at: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None


def _bug(message: str) -> StatecoreError:
    return StatecoreError(bug(message))


def node_context(context: object) -> NodeRequest:
    """The runner's context for an engine node's request, or a bug."""
    if not isinstance(context, NodeRequest):
        raise _bug(f"no node context for this request (got {type(context).__name__})")
    return context


class StreamReceiver:
    """A decode node's streamed handoff, read to its end: the prefill node's stream opened, each
    piece checked by the engine and kept in the stream's order while the stream is read on, the
    first token passed on at once, the handoff's figures in its record. One per handoff, made by
    `EnginePerformer` for a `FetchKv` of a streamed request."""

    def __init__(self, engine: Engine, peers: Peers, handoffs: HandoffLog) -> None:
        self.engine = engine
        self.peers = peers
        self.handoffs = handoffs

    async def receive(self, rid: RequestId, ctx: NodeRequest, post: Post) -> None:
        """Open the stream to the prefill node (which computes the prompt now), validate and keep
        each piece as it arrives, pass the first token on at once, and post the KV received at the
        stream's end."""
        assert ctx.prefill_url is not None
        record = self.handoffs.record(rid)
        record.streamed, record.attached = True, ctx.kv_attach
        opened = time.perf_counter()
        stream = self.peers.prefill_stream(ctx.prefill_url, rid, ctx.prompt, ctx.sampling, ctx.prefix_from,
                                           layers=len(self.engine.info.layers), attach=ctx.kv_attach)
        async with contextlib.aclosing(stream):
            await self._receive_items(rid, ctx, post, stream, record, opened)

    async def _receive_items(self, rid: RequestId, ctx: NodeRequest, post: Post,
                             stream: AsyncIterator[KvSegment | PrefillReply],
                             record: HandoffRecord, opened: float) -> None:
        """Read the stream to its end while its pieces are checked side by side and kept in order
        (`_keep_pieces`): a piece takes milliseconds to check (its CRC, its arrays built), and a
        first token read behind pieces still being checked goes on at once. The first failure,
        the stream's or a piece's, ends both and is raised."""
        finish: str | None = None
        received = segments = before_first = 0
        failures: list[Exception] = []
        send_piece, pieces = trio.open_memory_channel[KvSegment](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_pieces, rid, ctx, pieces, failures, nursery.cancel_scope)
            try:
                with send_piece:  # closed at the stream's end: the keeper then finishes the rest
                    async for item in stream:
                        if isinstance(item, KvSegment):
                            received += item.payload.nbytes
                            segments += 1
                            send_piece.send_nowait(item)
                            continue
                        before_first = received
                        finish = await self._first_token(item, ctx, record, opened, post)
            except Exception as exc:  # raised below, unwrapped, once the keeper has stopped
                failures.append(exc)
                nursery.cancel_scope.cancel()
            if not failures and finish is None and ctx.first_token is not None:
                # Every piece is with the engine: the install may be asked now, beside the last
                # pieces' checks (it waits for them), not one round trip after them. A piece that
                # fails still fails the request, from here.
                ctx.kv_pieces = segments
                self._stream_read(record, received, segments, before_first, opened)
                await post(KvReceived(received))
        if failures:
            raise failures[0]
        if ctx.first_token is None:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_TRUNCATED,
                                           "the prefill node's stream ended without a first token",
                                           origin=ctx.prefill_url))
        if finish is not None:  # the first token ended the request: nothing to install
            self._stream_read(record, received, segments, before_first, opened)
            await post(Finished(finish))

    @staticmethod
    def _stream_read(record: HandoffRecord, received: int, segments: int, before_first: int,
                     opened: float) -> None:
        """The stream's figures, once it was read to its end. The prefill node holds the cache
        (and any shared memory) until this node says it has taken it: the RELEASE_KV once
        installed, as a pulled cache."""
        record.wire_bytes = received
        record.segments = segments
        record.stream_s = time.perf_counter() - opened
        record.overlap = before_first / received if received else 0.0

    @staticmethod
    async def _first_token(item: PrefillReply, ctx: NodeRequest, record: HandoffRecord, opened: float,
                           post: Post) -> str | None:
        """The prefill node's first token, passed on at once; the finish it makes, if any."""
        record.first_token_s = time.perf_counter() - opened
        ctx.first_token_at = time.perf_counter()
        ctx.first_token = item.first_token
        ctx.cached_tokens = item.cached_tokens or 0
        ctx.ends_at_first_token = item.is_eos  # the prefill node's word, as the router takes it
        finish = first_token_finish(item.is_eos, hands_off=False)
        if finish is None:
            await post(PrefillDone(item.first_token, item.held_bytes, item.logprobs))
        return finish

    async def _keep_pieces(self, rid: RequestId, ctx: NodeRequest,
                           pieces: trio.MemoryReceiveChannel[KvSegment], failures: list[Exception],
                           scope: trio.CancelScope) -> None:
        """Each piece of the stream checked by the engine as it comes, beside the pieces before it
        still being checked, and kept in the stream's order (`index`: the engine keeps a piece
        after every earlier one, and none after one failed); a failure is noted and cancels the
        reading (`_receive_items` raises it). Done when every piece is kept."""
        async with pieces, trio.open_nursery() as checking:
            index = 0
            async for segment in pieces:
                checking.start_soon(self._keep_piece, rid, ctx, segment, index, failures, scope)
                index += 1

    async def _keep_piece(self, rid: RequestId, ctx: NodeRequest, segment: KvSegment, index: int,
                          failures: list[Exception], scope: trio.CancelScope) -> None:
        try:
            await self.engine.receive_segment(rid, segment, len(ctx.prompt),
                                              max_tokens=ctx.sampling.max_tokens, index=index)
        except Exception as exc:
            failures.append(from_prefill_node(exc, ctx))
            scope.cancel()


def from_prefill_node(exc: Exception, ctx: NodeRequest) -> Exception:
    """A streamed piece's failure as the engine raised it (checking it, or an install waiting for
    it): a peer's fault comes from the prefill node that sent the piece, and says so."""
    if not isinstance(exc, StatecoreError) or exc.info.fault is not Fault.PEER:
        return exc
    named = f"{ctx.prefill_url}: {exc.info.message}"
    failure = StatecoreError(replace(exc.info, message=named, origin=ctx.prefill_url))
    failure.__cause__ = exc
    return failure


class EnginePerformer:
    """Prefill, decode and single nodes: work through the local engine."""

    def __init__(
        self,
        engine: Engine,
        peers: Peers | None = None,
        faults: FaultPort = NO_FAULTS,
        crash_device: Callable[[], None] | None = None,
        handoffs: HandoffLog | None = None,
        prefix_pull: PrefixPuller | None = None,
    ) -> None:
        self.engine = engine
        self.peers = peers
        # a prefill node's pulls of the prompt's start from the decode node the router names
        self.prefix_pull = prefix_pull
        self.faults = faults
        # the DEVICE_CRASH fault's way to kill the engine's device thread; wired only when
        # `faults` is armed
        self.crash_device = crash_device
        # per-request handoff figures; the HTTP client fills the pull's part of the same records
        self.handoffs = handoffs if handoffs is not None else HandoffLog("node")
        # told of every request this node forgets (its end): what adapters hold for it goes too
        self.on_forget: list[Callable[[RequestId], object]] = []
        # a prefill node's pulls of held KV (`GET /internal/kv/{id}`) wait here for the answer
        # the core gives their `KvRequested`: `SendKv`'s export, or `RefuseKv`'s reason
        self.kv_pulls = KvPulls()
        # a prefill node's streamed handoffs (`POST /internal/prefill_stream`) read here what its
        # prefill computes for them: pieces, the first token, the end or an error
        self.kv_streams = KvStreams()

    def forget(self, request_id: RequestId, context: object) -> None:
        if request_id in self.kv_pulls.pending:
            self.kv_pulls.end(request_id)  # a puller still waiting learns the request is gone
        # so does a stream still sending, or not yet attached to: only a prefill node's requests
        # (their cache leaves: `hands_off`) have one
        if isinstance(context, NodeRequest) and context.hands_off and request_id in self.kv_streams:
            self.kv_streams.end(request_id)
        for hook in self.on_forget:
            hook(request_id)

    def answer(self, intent: Answer) -> None:
        self.kv_pulls.answer(intent.request_id, intent.error)

    def _crash_if_marked(self, rid: RequestId) -> None:
        """Tests only (the DEVICE_CRASH fault): kill the engine's device thread for this request,
        on a node that computes its prompt (prefill) or installs its handed-off KV (decode)."""
        if self.crash_device and self.faults.applies(Phase.DEVICE_CRASH, rid):
            self.crash_device()

    async def work(self, intent: WorkIntent, context: object, post: Post) -> None:
        rid = intent.request_id
        ctx = node_context(context)
        match intent:
            case StartPrefill():
                try:
                    await self._prefill(rid, ctx, post)
                except StatecoreError as exc:
                    # a streamed handoff's decode node hears why (no stream: nothing); the request fails here
                    self.kv_streams.send(rid, exc.info)
                    raise
                except Exception as exc:  # a bug: the decode node hears that too, not just "gone"
                    self.kv_streams.send(rid, bug(f"the prefill node failed to stream the KV: {exc!r}"))
                    raise
            case FetchKv():
                if self.peers is None or ctx.prefill_url is None:
                    raise _bug("FetchKv without a prefill node")
                if ctx.streamed:
                    await StreamReceiver(self.engine, self.peers, self.handoffs).receive(rid, ctx, post)
                    return
                ctx.payload = await self.peers.fetch_kv(ctx.prefill_url, rid)
                await post(KvReceived(len(ctx.payload)))
            case InstallKv():
                if ctx.first_token is None:
                    raise _bug("InstallKv before the first token")
                if (finish := after_first_token(ctx.sampling.max_tokens)) is not None:
                    await post(Finished(finish))
                    return
                if self.faults.armed:
                    await self.faults.at(Phase.INSTALL, rid)
                if ctx.payload is None and not ctx.streamed:
                    await self.engine.decode_held(rid, ctx.prompt, ctx.first_token, ctx.sampling)
                    await post(KvInstalled())
                    return
                self._crash_if_marked(rid)  # a decode node's device dies as a KV arrives
                started = time.perf_counter()
                if ctx.payload is not None:
                    payload, ctx.payload = ctx.payload, None
                    await self.engine.install(rid, payload, ctx.prompt, ctx.first_token, ctx.sampling)
                else:  # a stream's, asked beside its last pieces' checks: their failure is the prefill node's
                    try:
                        await self.engine.install_segments(rid, ctx.prompt, ctx.first_token, ctx.sampling,
                                                           pieces=ctx.kv_pieces)
                    except Exception as exc:
                        named = from_prefill_node(exc, ctx)
                        if named is exc:
                            raise
                        raise named from exc
                record = self.handoffs.record(rid)
                record.install_s, record.installed_at = time.perf_counter() - started, time.time()
                await post(KvInstalled())
            case StartDecode():
                steps = 0
                async for decoded in self.engine.stream(rid):  # the core's own events, a step's tokens as one
                    steps += 1
                    if steps == 1 and ctx.first_token_at is not None:
                        self.handoffs.record(rid).first_to_second_s = time.perf_counter() - ctx.first_token_at
                    if steps == 3 and self.faults.armed:  # a few steps in: a failure mid-stream
                        await self.faults.at(Phase.DECODE_STEP, rid)
                    await post(decoded)
                    if isinstance(decoded, Finished):
                        return
                raise StatecoreError(
                    ErrorInfo(Fault.BUG, Code.ENGINE_FAILED, "the decoder ended a stream early")
                )
            case SendKv():
                try:
                    if self.faults.armed:
                        await self.faults.at(Phase.KV_ENCODE, rid)
                    started = time.perf_counter()
                    exported = await self.engine.export_held(rid)
                except StatecoreError as exc:
                    self.kv_pulls.answer(rid, exc.info)  # the puller hears why; the request fails here
                    raise
                except Exception as exc:  # a bug: the puller hears that too, not just "gone"
                    self.kv_pulls.answer(rid, bug(f"the prefill node failed to export the KV: {exc!r}"))
                    raise
                record = self.handoffs.record(rid)
                record.encode_s = time.perf_counter() - started
                record.wire_bytes = exported.nbytes
                if not self.kv_pulls.answer(rid, exported):
                    log.info("request %s: its KV was exported after its puller gave up", rid)

    async def _prefill(self, rid: RequestId, ctx: NodeRequest, post: Post) -> None:
        """Prefill the prompt here (after pulling its start from the decode node holding it,
        when the router said so). A streamed handoff's pieces go out as the engine computes
        them (`_streamed_pieces`), then its first token, then what the engine could not cut into
        pieces (the whole cache of a family that travels whole), then its end."""
        self._crash_if_marked(rid)
        if self.faults.armed:
            await self.faults.at(Phase.PREFILL, rid)
        if ctx.prefix_from is not None and self.prefix_pull is not None:
            # never raises for the pull's own failures: the prefill then computes it all
            await self.prefix_pull.before_prefill(rid, ctx.prompt, ctx.prefix_from,
                                                  self.handoffs.record(rid))
        started = time.perf_counter()
        replied: list[PrefillOutcome] = []  # the first token, once told to the stream
        sink = self._streamed_pieces(rid, ctx, replied) if rid in self.kv_streams.open_streams else None
        outcome = await self.engine.prefill(rid, ctx.prompt, ctx.sampling, segments=sink,
                                            device_pieces=ctx.device_pieces)
        if ctx.hands_off:
            record = self.handoffs.record(rid)
            record.prefill_s, record.prefill_done_at = time.perf_counter() - started, time.time()
        if self.prefix_pull is not None:
            self.prefix_pull.prefilled(outcome, time.perf_counter() - started,
                                       self.engine.info.prefill_chunk_size)
        first_eos = self._first_token_known(ctx, outcome)
        if sink is not None:
            if not replied:
                self._reply(rid, outcome, first_eos)
            if self.faults.armed:
                await self.faults.at(Phase.KV_ENCODE, rid)
            if not outcome.streamed:
                started = time.perf_counter()
                whole = await self.engine.export_held(rid)
                self.handoffs.record(rid).encode_s = time.perf_counter() - started
                sink(KvSegment(0, len(ctx.prompt), 0, len(self.engine.info.layers), whole))
            self.kv_streams.send(rid, None)
        if (finish := first_token_finish(first_eos, hands_off=ctx.hands_off)) is not None:
            await post(Finished(finish))  # a local request whose first token ends it
        else:
            await post(PrefillDone(outcome.first_token, outcome.held_bytes, outcome.first_logprobs))

    def _first_token_known(self, ctx: NodeRequest, outcome: PrefillOutcome) -> bool:
        """The request's context told its first token; whether that token ends it (EOS)."""
        ctx.first_token = outcome.first_token
        ctx.cached_tokens = outcome.cached_tokens  # set before anyone hears of the prefill
        ctx.ends_at_first_token = first_eos = first_token_ends(
            outcome.first_token, self.engine.info.eos_token_ids, ignore_eos=ctx.sampling.ignore_eos)
        return first_eos

    def _reply(self, rid: RequestId, outcome: PrefillOutcome, first_eos: bool) -> None:
        self.kv_streams.send(rid, PrefillReply(outcome.first_token, first_eos, outcome.held_bytes,
                                               outcome.first_logprobs, outcome.cached_tokens))

    def _streamed_pieces(self, rid: RequestId, ctx: NodeRequest, replied: list[PrefillOutcome]
                         ) -> SegmentSink:
        """Where a streamed prefill's pieces go: the request's stream, counted in its record; its
        first token goes there as soon as the engine tells it, ahead of the last pieces."""
        record = self.handoffs.record(rid)
        record.streamed = True
        record.segments = 0

        def sent(item: KvSegment | PrefillOutcome) -> None:
            if isinstance(item, PrefillOutcome):
                if not replied:
                    replied.append(item)
                    self._reply(rid, item, self._first_token_known(ctx, item))
                return
            record.wire_bytes = (record.wire_bytes or 0) + item.payload.nbytes
            record.segments = (record.segments or 0) + 1
            self.kv_streams.send(rid, item)

        return sent

    async def cleanup(self, intent: CleanupIntent, context: object) -> None:
        rid = intent.request_id
        ctx = context if isinstance(context, NodeRequest) else None
        match intent:
            case ReleaseKv():
                await self.engine.release_held(rid)
                if ctx and ctx.prefill_url and self.peers:
                    await self.peers.release_kv(ctx.prefill_url, rid)
                    ctx.prefill_url = None  # tell the owner once
            case StopDecoding():
                await self.engine.cancel(rid)
            case CancelRemote(finish_reason=reason):
                await self.engine.cancel(rid)
                await self.engine.release_held(rid)
                if ctx and ctx.prefill_url and self.peers:
                    await self.peers.cancel(ctx.prefill_url, rid, finish_reason=reason)


@dataclass(slots=True)
class RoutedRequest:
    """What the router keeps for one request."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    # this attempt prefills on its decode node: the attempt's route says (statecore.routing's
    # choose_route, through the router's RoutePicker), nothing else
    local: bool = False
    streamed: bool = False  # this attempt's KV streams from the prefill node as it is computed
    first_token: int | None = None
    prefill_node: str | None = None
    decode_node: str | None = None
    retry: RetryState = field(default_factory=RetryState)
    # (node, the id this attempt used there): what the current attempt may hold remotely
    remote: list[tuple[str, RequestId]] = field(default_factory=list)
    cached_tokens: int = 0  # of the prompt, taken from a prefix cache by the node that prefilled it
    prefilling_on: str | None = None  # the node computing its prompt until the first token is back

    def node_request_id(self, request_id: RequestId) -> RequestId:
        return self.retry.node_request_id(request_id)


# (role, nodes to avoid, the prompt it will prefill or None, request id) -> url; raises when none
NodePicker = Callable[[str, set[str], Sequence[int] | None, str], str]
# (nodes to avoid, the prompt, request id) -> the turn's route and decode node; raises when none
RoutePicker = Callable[[set[str], Sequence[int], str], RouteChoice]


class RouterPerformer:
    """The router: prefill on a prefill node (or the decode node for short prompts), then
    decode on a decode node; relay every token as an event."""

    def __init__(
        self,
        peers: Peers,
        pick: NodePicker,
        route: RoutePicker,
        *,
        max_attempts: int = 3,
        in_flight: dict[str, int] | None = None,
        prefilling: dict[str, int] | None = None,
        on_peer_failure: Callable[[str, ErrorInfo], None] | None = None,
        streams: Callable[[str, str], bool] = lambda prefill, decode: False,
        attaches: Callable[[str, str], bool] = lambda prefill, decode: False,
    ) -> None:
        self.peers = peers
        self.pick = pick
        # (prefill node, decode node) -> whether a handoff between them streams the KV while the
        # prompt is computed (the decode node asks the prefill node); else the decode node pulls
        # the whole KV after the first token
        self.streams = streams
        # (prefill node, decode node) -> whether the router starts such a streamed handoff's
        # prefill itself, the decode node attaching to its stream (one hop less before the prefill)
        self.attaches = attaches
        # Each attempt's route: its decode node and whether that node prefills the prompt itself
        # (short, or its start held there, or an overflow) or a prefill node does (statecore.routing).
        self.route = route
        self.max_attempts = max_attempts
        self.in_flight = in_flight if in_flight is not None else {}
        # prompt tokens each node is computing for requests whose first token is not back
        self.prefilling = prefilling if prefilling is not None else {}
        self.on_peer_failure = on_peer_failure
        # The live choices of each client request with n > 1 (SamplingParams.choice_group): where
        # one decodes, the others follow. Entries leave with `forget`.
        self.choice_groups: dict[str, list[RoutedRequest]] = {}

    def forget(self, request_id: RequestId, context: object) -> None:
        if isinstance(context, RoutedRequest):
            self._release_nodes(context)
            key = context.sampling.choice_group
            group = self.choice_groups.get(key)
            if group is not None:
                group[:] = [other for other in group if other is not context]
                if not group:
                    del self.choice_groups[key]

    def _take(self, node: str) -> str:
        self.in_flight[node] = self.in_flight.get(node, 0) + 1
        return node

    def _prefilling(self, ctx: RoutedRequest, node: str | None) -> None:
        """The node now computing the request's prompt (None: none, its first token is back)."""
        if ctx.prefilling_on is not None:
            left = self.prefilling.get(ctx.prefilling_on, 0) - len(ctx.prompt)
            if left > 0:
                self.prefilling[ctx.prefilling_on] = left
            else:
                self.prefilling.pop(ctx.prefilling_on, None)
        ctx.prefilling_on = node
        if node is not None:
            self.prefilling[node] = self.prefilling.get(node, 0) + len(ctx.prompt)

    def _release_nodes(self, ctx: RoutedRequest) -> None:
        self._prefilling(ctx, None)
        for node in (ctx.prefill_node, ctx.decode_node):
            if node is not None and self.in_flight.get(node, 0) > 0:
                self.in_flight[node] -= 1

    async def work(self, intent: WorkIntent, context: object, post: Post) -> None:
        rid = intent.request_id
        if not isinstance(context, RoutedRequest):
            raise _bug(f"no context for request {rid}")
        ctx = context
        match intent:
            case StartPrefill():
                await self._start(rid, ctx, post)
            case StartDecode():
                if ctx.local or ctx.streamed:
                    return  # the decode node's stream, opened at StartPrefill, carries on
                if (finish := after_first_token(ctx.sampling.max_tokens)) is not None:
                    await post(Finished(finish))
                    return
                assert ctx.decode_node is not None and ctx.first_token is not None
                call = DecodeCall(
                    ctx.node_request_id(rid), ctx.prompt, ctx.sampling, ctx.first_token, ctx.prefill_node
                )
                try:
                    await self._relay(ctx, self.peers.decode(ctx.decode_node, call), post)
                except StatecoreError as exc:
                    self._blame(self._culprit(ctx, exc.info), exc.info)
                    raise
            case FetchKv() | InstallKv() | SendKv():
                raise _bug(f"{intent.kind.value} is not a router intent")

    async def _cancel_remote(self, ctx: RoutedRequest, finish_reason: str | None = None) -> None:
        """Tell every node the current attempt used to stop and free what it holds (as a normal
        end when the request ended normally here)."""
        held, ctx.remote = ctx.remote, []
        for node, node_rid in held:
            with trio.move_on_after(5), contextlib.suppress(StatecoreError):
                await self.peers.cancel(node, node_rid, finish_reason=finish_reason)

    async def _start(self, rid: RequestId, ctx: RoutedRequest, post: Post) -> None:
        with trio.CancelScope(shield=True):
            await self._cancel_remote(ctx)  # a previous, failed attempt's leftovers
        self._release_nodes(ctx)
        ctx.prefill_node = ctx.decode_node = None
        ctx.streamed = False
        ctx.retry = ctx.retry.started()
        nid = ctx.node_request_id(rid)
        avoid = set(ctx.retry.tried)
        prefix_from: PrefixSource | None = None
        try:
            choice = self.route(avoid, ctx.prompt, nid)
            ctx.local = choice.local
            routed = choice.decode.node
            if choice.route is Route.PREFILL_NODE_PREFIX:
                prefix_from = PrefixSource(routed, choice.held_tokens)
            # every choice of one request decodes where its first one went (the same bytes)
            ctx.decode_node = self._take(self._siblings_decode_node(ctx) or routed)
            ctx.remote.append((ctx.decode_node, nid))
            if not ctx.local:
                ctx.prefill_node = self._take(self.pick("prefill", avoid, ctx.prompt, nid))
                ctx.remote.append((ctx.prefill_node, nid))
            ctx.streamed = ctx.prefill_node is not None and self.streams(ctx.prefill_node, ctx.decode_node)
            self._prefilling(ctx, ctx.decode_node if ctx.local else ctx.prefill_node)
            await post(Dispatched())
            if ctx.streamed and self.attaches(ctx.prefill_node or "", ctx.decode_node):
                await self._start_attached_stream(ctx, nid, prefix_from, post)
                return
            if ctx.local or ctx.streamed:
                # the decode node prefills, or has the prefill node prefill and stream it the KV:
                # either way the first token comes first on its stream
                call = DecodeCall(nid, ctx.prompt, ctx.sampling, None, ctx.prefill_node,
                                  kv_stream=ctx.streamed, prefix_from=prefix_from)
                await self._relay(ctx, self.peers.decode(ctx.decode_node, call), post)
                return
            reply = await self.peers.prefill(ctx.prefill_node or "", nid, ctx.prompt, ctx.sampling,
                                             prefix_from)
        except StatecoreError as exc:
            self._blame(self._culprit(ctx, exc.info), exc.info)
            ctx.retry, verdict = attempt_failed(ctx.retry, exc.info, used=(ctx.prefill_node, ctx.decode_node),
                                                first_token_sent=ctx.first_token is not None,
                                                max_attempts=self.max_attempts)
            if verdict.retry:
                await trio.sleep(verdict.backoff_s)
                await post(RetryRequested(exc.info))
                return
            raise
        await self._first(reply, ctx, post)

    async def _start_attached_stream(self, ctx: RoutedRequest, nid: RequestId,
                                     prefix_from: PrefixSource | None, post: Post) -> None:
        """A streamed handoff the router starts itself: the prefill node is asked to prefill (its
        answer, the first token, comes straight back here), and once that call's request is
        written (it starts the prefill: the first token waits on it, not on the decode node's
        call) the decode node attaches to that prefill's stream (`DecodeCall.kv_attach`), whose
        first token, the same, comes through it too. Whichever comes first is posted, once. The
        first failure ends both calls (the node it comes from is the one blamed: `_culprit`);
        so does a first token that ends the request. Once the first token was told, the prefill
        node's part is done: its call failing then ends nothing (the decode node streams on, and
        frees the prefill node's cache with its DELETE, or the lease), though peer health hears
        of it."""
        prefill_node, decode_node = ctx.prefill_node, ctx.decode_node
        assert prefill_node is not None and decode_node is not None
        told = trio.Lock()
        ended = False  # the first token ended the request
        prefill_sent = trio.Event()  # its request written, or the call over

        async def first(reply: PrefillReply) -> bool:
            nonlocal ended
            async with told:
                if ctx.first_token is None and not ended:
                    ended = await self._first(reply, ctx, post)
            return ended

        failures: list[StatecoreError] = []
        async with trio.open_nursery() as nursery:

            async def prefill() -> None:
                try:
                    reply = await self.peers.prefill(prefill_node, nid, ctx.prompt, ctx.sampling, prefix_from,
                                                     attach_by=decode_node, on_sent=prefill_sent.set)
                except StatecoreError as exc:
                    if ctx.first_token is not None:  # told already (through the decode node)
                        self._blame(self._culprit(ctx, exc.info), exc.info)
                        return
                    failures.append(exc)
                    nursery.cancel_scope.cancel()
                    return
                finally:
                    prefill_sent.set()
                if await first(reply):
                    nursery.cancel_scope.cancel()  # nothing follows: the decode node's stream goes

            nursery.start_soon(prefill)
            await prefill_sent.wait()
            call = DecodeCall(nid, ctx.prompt, ctx.sampling, None, prefill_node, kv_stream=True,
                              kv_attach=True)
            try:
                await self._relay(ctx, self.peers.decode(decode_node, call), post, first=first)
            except StatecoreError as exc:  # its own failure, or the prefill node's that it relays
                failures.append(exc)
            nursery.cancel_scope.cancel()  # the stream ended: the prefill node's answer is not needed
        if failures:
            raise failures[0]

    def _siblings_decode_node(self, ctx: RoutedRequest) -> str | None:
        """Where another choice of the same client request (n > 1) decodes, unless this attempt
        avoids it (`routing.avoiding`, with the route's pick to fall back on: none here): the
        choices decode side by side there, as on a single node, whose bytes they then are (a
        batched row's last bits depend on the rows beside it)."""
        sampling = ctx.sampling
        if sampling.choices <= 1 or not sampling.choice_group:
            return None
        group = self.choice_groups.setdefault(sampling.choice_group, [])
        if not any(other is ctx for other in group):
            group.append(ctx)
        siblings = [node for other in group if other is not ctx and (node := other.decode_node) is not None]
        kept = avoiding(siblings, ctx.retry.tried, otherwise=())
        return kept[0] if kept else None

    @staticmethod
    def _culprit(ctx: RoutedRequest, error: ErrorInfo) -> str | None:
        """The node a failed attempt's error comes from (`ErrorInfo.origin`: the node called, or
        the one whose error it passed on), when it is one the attempt used; else none (no node
        was reached: the route found none)."""
        return error.origin if error.origin in (ctx.prefill_node, ctx.decode_node) else None

    def _blame(self, node: str | None, error: ErrorInfo) -> None:
        """Tell peer health that this node failed, when the policy blames it."""
        if self.on_peer_failure is not None and node is not None and blames_peer(error):
            self.on_peer_failure(node, error)

    async def _first(self, reply: PrefillReply, ctx: RoutedRequest, post: Post) -> bool:
        """Post the prefill's first token, or the request's end when that token ends it
        (`first_token_finish`); True when it ended."""
        self._prefilling(ctx, None)
        ctx.cached_tokens = reply.cached_tokens or 0  # set before the first token's event
        if (finish := first_token_finish(reply.is_eos, hands_off=False)) is not None:
            await post(Finished(finish))
            return True
        ctx.first_token = reply.first_token
        await post(FirstToken(reply.first_token, reply.logprobs))
        return False

    async def _relay(
        self, ctx: RoutedRequest, messages: AsyncIterator[DecodeMessage], post: Post,
        first: Callable[[PrefillReply], Awaitable[bool]] | None = None,
    ) -> None:
        """Turn a decode node's messages into events (the first token, if it prefilled or took a
        streamed handoff, through `first` where another call may tell it too)."""
        async for message in messages:
            match message:
                case PrefillReply():
                    if await (self._first(message, ctx, post) if first is None else first(message)):
                        return
                case TokensGenerated():
                    await post(message)
                case Finished():
                    await post(message)
                    return
                case ErrorInfo():
                    raise StatecoreError(message)
        raise StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST,
                                       "the decode node's stream ended early", origin=ctx.decode_node))

    def answer(self, intent: Answer) -> None:
        # the router's table names no answer (nobody pulls KV from a router): a bug, logged
        log.error("router: bug: %s for %s", intent.kind.value, intent.request_id)

    async def cleanup(self, intent: CleanupIntent, context: object) -> None:
        if not isinstance(context, RoutedRequest):
            return
        ctx = context
        match intent:
            case CancelRemote(finish_reason=reason):
                await self._cancel_remote(ctx, reason)
            case ReleaseKv() | StopDecoding():
                pass


# -- the front end's backend over each role's runner -----------------------------------------


def local_backend(
    runner: NodeRunner[Any], performer: EnginePerformer, *, max_live: int = 256
) -> RunnerBackend:
    """A single node (or a decode node serving its own short prompts): every request prefills and
    decodes here."""

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


__all__ = [
    "EnginePerformer",
    "NodePicker",
    "NodeRequest",
    "RoutePicker",
    "RoutedRequest",
    "RouterPerformer",
    "local_backend",
    "node_context",
    "router_backend",
]
