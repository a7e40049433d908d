"""Where a prefill node's held KV meets the pulls waiting for it, by request id.

A decode node's pull (`GET /internal/kv/{id}`) waits here (`pull`) for the answer to the
`KvRequested` event it posts; the core decides that answer, and the interpreter delivers it:
the exported KV for the request's `SendKv`, the reason for its `RefuseKv`, and, when the request
ends before either, that it ended. Nothing is kept in the request's context, and whether a pull
may have the KV is never asked here: it is the table's. This module may import `statecore` and
trio; never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

from effects.ports import KvPieces
from statecore.errors import Code, ErrorInfo, Fault
from statecore.ids import RequestId

KvAnswer = KvPieces | ErrorInfo


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
        gone = ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND, f"request {request_id} ended before its KV was sent")
        while self.answer(request_id, gone):
            pass

    def __len__(self) -> int:
        """Pulls waiting now (for leak checks)."""
        return sum(len(pulls) for pulls in self.pending.values())


__all__ = ["KvAnswer", "KvPull", "KvPulls"]
