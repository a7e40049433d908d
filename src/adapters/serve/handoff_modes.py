"""Which of the router's engine nodes take a streamed handoff, as their `/internal/info` says.

A node whose engine cannot take the KV as it streams (tensor or pipeline parallel: `"kv_stream":
false` in its info) is pulled from; so is one whose info the router has not read yet: a pull is
what every node takes, a stream only an optimization, and a node that was still loading (or too
slow to answer) when the router started must not get streams it refuses with a 400 for as long as
the router lives. `HandoffModes.run` keeps asking the nodes not heard from yet until each answered.
A streamed handoff between two nodes that both say `"kv_attach": true` is started by the router
itself (it posts the prefill node and the decode node at once; the decode node attaches to the
prefill's stream), unless `--kv-handoff stream-via-decode` keeps the decode node asking for it.
This module may import anything; nothing in `statecore` or `effects` imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

import trio

log = logging.getLogger("statecore.router")

__all__ = ["HandoffModes"]

ASK_AGAIN_S = 2.0

Document = Mapping[str, object] | None


class HandoffModes:
    """The router's view of which nodes take streamed handoffs (trio-side only)."""

    def __init__(self, documents: Mapping[str, Document], ask: Callable[[str], Awaitable[Document]],
                 *, stream: bool, attach: bool = True) -> None:
        """`documents`: each node's /internal/info as read at start (None: no answer yet);
        `ask(node)` reads it again; `stream`: `--kv-handoff stream` (else every handoff pulls);
        `attach`: the router starts a streamed handoff's prefill where both nodes take that."""
        self._stream = stream
        self._attach = attach
        self._ask = ask
        self._takes_streams: dict[str, bool | None] = {
            node: _takes_streams(doc) for node, doc in documents.items()}
        self._takes_attach: dict[str, bool] = {node: _takes_attach(doc) for node, doc in documents.items()}

    def streams(self, prefill_node: str, decode_node: str) -> bool:
        """Whether the handoff from `prefill_node` to `decode_node` streams (else it is pulled)."""
        return self._stream and all(self._takes_streams.get(node) for node in (prefill_node, decode_node))

    def attaches(self, prefill_node: str, decode_node: str) -> bool:
        """Whether the router starts that streamed handoff's prefill itself (the decode node attaches)."""
        return self._attach and all(self._takes_attach.get(node, False)
                                    for node in (prefill_node, decode_node))

    @property
    def unknown(self) -> list[str]:
        return [node for node, takes in self._takes_streams.items() if takes is None]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ask each node not heard from yet, every ASK_AGAIN_S, until every one has answered."""
        task_status.started()
        while self._stream and (waiting := self.unknown):
            await trio.sleep(ASK_AGAIN_S)
            for node in waiting:
                document = await self._ask(node)
                takes = _takes_streams(document)
                if takes is not None:
                    self._takes_streams[node] = takes
                    self._takes_attach[node] = _takes_attach(document)
                    log.info("%s answered /internal/info: its handoffs %s", node,
                             "stream" if takes else "are pulled (it takes no streamed handoff)")


def _takes_streams(document: Document) -> bool | None:
    """A node's info says whether it takes streams (a node before the field existed does)."""
    if document is None:
        return None
    return document.get("kv_stream") is not False


def _takes_attach(document: Document) -> bool:
    """A node's info says it takes a streamed handoff's prefill started by the router (a node
    before the field existed does not)."""
    return document is not None and document.get("kv_attach") is True
