"""Where a prefill node's KV meets the peers waiting for it, by request id: pulls of held KV and
streamed handoffs.

A decode node's pull (`GET /internal/kv/{id}`) waits in `KvPulls` for the answer to the
`KvRequested` event it posts; the core decides that answer, and the interpreter delivers it:
the exported KV for the request's `SendKv`, the reason for its `RefuseKv`, and, when the request
ends before either, that it ended. A decode node's streamed handoff (`POST
/internal/prefill_stream`) reads from `KvStreams` what the interpreter delivers as the prefill
computes it: the cache's pieces, the first token, the end (or the error that ends it); a
request that ends first tells its stream so. A stream the router started (`POST /internal/prefill`
with `kv_attach`) is opened before its decode node asks for it: its items wait in the channel until
its request is admitted (`ready_for_attach`, with how to cancel it) and the decode node attaches
(`attach`), and the router's call waits for its first token alone (`first_reply`). Either waiter
hears the same KV_NOT_FOUND when its
request ends before its KV was sent (`ended_before_sent`, the one place that says it). Nothing is
kept in the request's context, and whether a pull may have the KV is never asked here: it is the
table's. This module may import `statecore` and trio; never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import trio

from effects.ports import KvPieces, KvSegment, PrefillReply
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.ids import RequestId

KvAnswer = KvPieces | ErrorInfo

# What a streamed handoff reads, in order: pieces of the cache as they are computed, the first
# token, then None (the end); or an error, which ends it.
StreamItem = KvSegment | PrefillReply | ErrorInfo | None

# Ends a request as its client leaving does (its generation's `cancel`, which the runner's
# instruments hear).
Cancel = Callable[[], Awaitable[None]]


def ended_before_sent(request_id: RequestId) -> ErrorInfo:
    """What a pull or a stream hears when its request ended before its KV was sent."""
    return ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND, f"request {request_id} ended before its KV was sent")


class KvPull:
    """One pull's wait for its answer."""

    def __init__(self) -> None:
        self._answered = trio.Event()
        self._answer: KvAnswer | None = None

    def answer(self, answer: KvAnswer) -> None:
        self._answer = answer
        self._answered.set()

    @property
    def answered(self) -> bool:
        return self._answered.is_set()

    async def wait(self) -> KvAnswer:
        await self._answered.wait()
        assert self._answer is not None
        return self._answer


class KvPulls:
    """The pulls waiting on this node, oldest first per request: each answer goes to the oldest
    pull of its request not yet answered (one `KvRequested` asks for one answer)."""

    def __init__(self) -> None:
        # the pulls waiting, by request (read it, never change it: `pull` and `answer` do)
        self.pending: dict[RequestId, list[KvPull]] = {}

    @contextmanager
    def pull(self, request_id: RequestId) -> Iterator[KvPull]:
        """A pull for the request, waiting from now (before its event is posted, so that no
        answer can come first) until the block ends."""
        pull = KvPull()
        self.pending.setdefault(request_id, []).append(pull)
        try:
            yield pull
        finally:
            pulls = self.pending.get(request_id, [])
            if pull in pulls:
                pulls.remove(pull)
            if not pulls:
                self.pending.pop(request_id, None)

    def answer(self, request_id: RequestId, answer: KvAnswer) -> bool:
        """Give the oldest pull of the request still waiting its answer; False when none waits
        (it gave up: its deadline passed, or its client went away)."""
        for pull in self.pending.get(request_id, []):
            if not pull.answered:
                pull.answer(answer)
                return True
        return False

    def end(self, request_id: RequestId) -> None:
        """The request is over: every pull still waiting for it hears so."""
        gone = ended_before_sent(request_id)
        while self.answer(request_id, gone):
            pass

    def __len__(self) -> int:
        """Pulls waiting now (for leak checks)."""
        return sum(len(pulls) for pulls in self.pending.values())


# How long a router-started stream whose request ended unattached says why to a decode node that
# attaches late (the router's cancel usually reaches that node first).
GONE_KEPT_S = 10.0


class _FirstReply:
    """A router-started stream's first token (or why it will not come), for the router's call."""

    def __init__(self) -> None:
        self._told = trio.Event()
        self.reply: PrefillReply | ErrorInfo | None = None

    def tell(self, reply: PrefillReply | ErrorInfo) -> None:
        if not self._told.is_set():
            self.reply = reply
            self._told.set()

    async def wait(self) -> PrefillReply | ErrorInfo:
        await self._told.wait()
        assert self.reply is not None
        return self.reply


@dataclass(slots=True)
class _Unattached:
    """A router-started stream no decode node has attached to yet."""

    items: trio.MemoryReceiveChannel[StreamItem]  # its reading end: what the prefill sent waits in it
    cancel: Cancel | None = None  # its request's, once admitted: only then may a decode node attach
    last_error: ErrorInfo | None = None  # its last item, where that was an error


@dataclass(frozen=True, slots=True)
class AttachedStream:
    """A router-started stream as the decode node that attached to it reads it."""

    items: trio.MemoryReceiveChannel[StreamItem]
    cancel: Cancel  # the request's generation's: a decode node that leaves early ends it so


class KvStreams:
    """The streamed handoffs this node serves, one per request: what the interpreter sends for a
    request goes to its stream's channel, which the stream reads until the request ends."""

    def __init__(self) -> None:
        # each stream's sending end, by request: a request in it has a stream waiting for its
        # pieces (its prefill then cuts them out); read it, never change it (`open`, `send` and
        # `end` do)
        self.open_streams: dict[RequestId, trio.MemorySendChannel[StreamItem]] = {}
        self._unattached: dict[RequestId, _Unattached] = {}  # router-started streams, until attached to
        self._first: dict[RequestId, _FirstReply] = {}  # router-started streams' first tokens
        # decode nodes that came before their stream could be attached to, waiting
        self._attach_waits: dict[RequestId, trio.Event] = {}
        # router-started streams whose request ended before a decode node attached: why (the error
        # that ended it, else `ended_before_sent`), for a decode node that attaches later, until when
        self._gone: dict[RequestId, tuple[ErrorInfo, float]] = {}

    def open(self, request_id: RequestId, prompt_tokens: int, layers: int
             ) -> trio.MemoryReceiveChannel[StreamItem]:
        """A stream for a prompt of `prompt_tokens` of a model of `layers` layers, open from now
        (before the request is admitted, so that nothing its prefill sends is lost) until its
        last item (the end, or an error) or the request's end (`end`). Its bound is the most items
        one prefill can send, so a send never waits: every piece holds at least one token of one
        layer, then come the first token and the last item. A request that has a stream already
        is refused."""
        if request_id in self.open_streams or request_id in self._unattached:
            raise StatecoreError(client_error(f"duplicate request id {request_id!r}"))
        send, receive = trio.open_memory_channel[StreamItem](prompt_tokens * max(1, layers) + 2)
        self.open_streams[request_id] = send
        return receive

    def open_for_attach(self, request_id: RequestId, prompt_tokens: int, layers: int) -> None:
        """A stream the router started: open as `open`, kept here until a decode node attaches,
        which it may once its request is admitted (`ready_for_attach`)."""
        self._unattached[request_id] = _Unattached(self.open(request_id, prompt_tokens, layers))
        self._first[request_id] = _FirstReply()

    def ready_for_attach(self, request_id: RequestId, cancel: Cancel) -> None:
        """The router-started stream's request was admitted (`cancel` ends it as its client
        leaving does): its decode node may attach from now."""
        waiting = self._unattached.get(request_id)
        if waiting is not None:
            waiting.cancel = cancel
            self._wake_attach(request_id)

    async def attach(self, request_id: RequestId, wait_s: float) -> AttachedStream:
        """The router-started stream of the request, for the decode node that attaches to it
        (once); waits up to `wait_s` for its request to be admitted (the router's call that opens
        it and the decode node's race). A request that ended before anyone attached raises why it
        ended (its error, as the stream would have said it) for `wait_s` after; KV_NOT_FOUND when
        none is admitted in time, or it was attached to."""
        self._forget_gone()
        if not self._attach_answerable(request_id):
            arrived = self._attach_waits.setdefault(request_id, trio.Event())
            with trio.move_on_after(wait_s):
                await arrived.wait()
            if self._attach_waits.get(request_id) is arrived:
                del self._attach_waits[request_id]
        if (gone := self._gone.pop(request_id, None)) is not None:
            raise StatecoreError(gone[0])
        waiting = self._unattached.get(request_id)
        if waiting is None or waiting.cancel is None:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND,
                                           f"no prefill of request {request_id} waits for its decode node"))
        del self._unattached[request_id]
        return AttachedStream(waiting.items, waiting.cancel)

    def _attach_answerable(self, request_id: RequestId) -> bool:
        """Whether an attach to the request's stream is answered at once: it may be attached to,
        or it ended, or it is open and no longer waits for its decode node (attached to already,
        or asked for by its decode node)."""
        if (waiting := self._unattached.get(request_id)) is not None:
            return waiting.cancel is not None
        return request_id in self._gone or request_id in self.open_streams

    def _wake_attach(self, request_id: RequestId) -> None:
        if (arrived := self._attach_waits.pop(request_id, None)) is not None:
            arrived.set()

    def _forget_gone(self) -> None:
        now = trio.current_time()
        for request_id in [rid for rid, (_, until) in self._gone.items() if until < now]:
            del self._gone[request_id]

    async def first_reply(self, request_id: RequestId) -> PrefillReply | ErrorInfo:
        """A router-started stream's first token, as soon as the prefill tells it (ahead of its
        last pieces); or the error that ended the request first."""
        first = self._first.get(request_id)
        if first is None:
            return ended_before_sent(request_id)
        return await first.wait()

    def send(self, request_id: RequestId, item: StreamItem) -> None:
        """Hand the request's stream its next item; nothing when it has none or its reader left.
        The last item (the end, None, or an error) closes the stream: nothing follows it."""
        if isinstance(item, PrefillReply | ErrorInfo) and (first := self._first.get(request_id)) is not None:
            first.tell(item)
        send = self.open_streams.get(request_id)
        if send is not None:
            if isinstance(item, ErrorInfo) and (waiting := self._unattached.get(request_id)) is not None:
                waiting.last_error = item
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                send.send_nowait(item)
            if item is None or isinstance(item, ErrorInfo):
                self._close(request_id)

    def end(self, request_id: RequestId) -> None:
        """The request is over (or was never admitted): a stream still open reads what is left,
        then that its request ended before its KV was sent; one no decode node attached to goes."""
        self.send(request_id, ended_before_sent(request_id))
        self._first.pop(request_id, None)
        if (waiting := self._unattached.pop(request_id, None)) is not None:
            waiting.items.close()  # its pieces go; why it ended stays for a decode node still to come
            why = waiting.last_error or ended_before_sent(request_id)
            self._gone[request_id] = (why, trio.current_time() + GONE_KEPT_S)
            self._wake_attach(request_id)

    def _close(self, request_id: RequestId) -> None:
        send = self.open_streams.pop(request_id, None)
        if send is not None:
            send.close()

    def __contains__(self, request_id: RequestId) -> bool:
        """Whether the request has a stream here, attached to or not, or a first token kept for
        the router's call."""
        return request_id in self.open_streams or request_id in self._unattached or request_id in self._first

    def __len__(self) -> int:
        """Streams open now, or waiting for their decode node (for leak checks)."""
        return len(self.open_streams.keys() | self._unattached.keys())


__all__ = ["AttachedStream", "Cancel", "KvAnswer", "KvPull", "KvPulls", "KvStreams", "StreamItem",
           "ended_before_sent"]
