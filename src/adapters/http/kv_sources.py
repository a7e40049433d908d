"""Where a decode node reads a prefill node's KV from: the prefill node's KV plane (a socket of
its own for KV bodies, `adapters.kv.plane`) when it has one this node can reach, and its shared
memory (`adapters.kv.shm`) when its advert proves it is on this host. Each is probed once per
prefill node, from its /internal/info; a plane connection that fails makes the next call probe
again. Used by `HttpxPeers`. This module may import anything.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import trio

from adapters.kv import shm as kv_shm
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

log = logging.getLogger("statecore.peers")

InfoDocument = Callable[[str], Awaitable[dict[str, object]]]


class KvSources:
    """A decode node's knowledge of its prefill nodes' KV planes and shared memory."""

    def __init__(self, info_document: InfoDocument, *, direct: bool, kv_transport: str,
                 connect_timeout_s: float) -> None:
        self.info_document = info_document  # a node's whole /internal/info
        # KV bodies are read directly (`adapters.kv.pull`), not through a transport a test injected
        self.direct = direct
        # "auto" maps a prefill node's shared memory when its advert proves it is on this host,
        # "http" never does, "shm" insists (KV_SHM_GONE if not)
        self.kv_transport = kv_transport
        self.connect_timeout_s = connect_timeout_s
        self._inboxes: dict[str, kv_shm.ShmInbox | None] = {}  # by prefill node, once probed
        self._planes: dict[str, int | None] = {}  # a prefill node's KV plane port, once probed

    async def on_plane(self, node: str, url: str) -> str:
        """`url` moved to the node's KV plane (`adapters.kv.plane`) when it has one this node can
        reach: plain http, KV bodies read directly (not through an injected transport), the port
        in its /internal/info, a connection to it accepted. Probed once per node; a later
        connection error (the node restarted elsewhere) makes the next call probe again."""
        if not (self.direct and url.startswith("http://")):
            return url
        if node not in self._planes:
            self._planes[node] = await self._probe_plane(node)
        port = self._planes[node]
        if port is None:
            return url
        parts = urlsplit(url)
        host = parts.hostname or ""
        return urlunsplit(parts._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}"))

    async def _probe_plane(self, node: str) -> int | None:
        try:
            port = (await self.info_document(node)).get("kv_port")
        except StatecoreError:
            return None
        if not isinstance(port, int) or not 0 < port < 65536:
            return None
        try:
            with trio.fail_after(self.connect_timeout_s):
                probe = await trio.open_tcp_stream(urlsplit(node).hostname or "", port)
        except (OSError, trio.TooSlowError):
            log.warning("%s advertises a KV plane on port %d that cannot be reached: its KV comes "
                        "through its HTTP port", node, port)
            return None
        await probe.aclose()
        return port

    @contextlib.contextmanager
    def plane_watched(self, node: str) -> Iterator[None]:
        """A connection to the node's KV plane that fails makes the next call probe it again."""
        try:
            yield
        except (OSError, trio.BrokenResourceError):
            self._planes.pop(node, None)
            raise
        except StatecoreError as exc:
            if exc.info.fault is Fault.TRANSPORT:
                self._planes.pop(node, None)
            raise

    async def inbox(self, node: str) -> kv_shm.ShmInbox | None:
        """The prefill node's shared memory, mapped here, when `kv_transport` allows it and the
        node's advert (its /internal/info) proves it is on this host; probed once per node."""
        if self.kv_transport == "http":
            return None
        if node not in self._inboxes:
            try:
                advert = kv_shm.parse_advert((await self.info_document(node)).get("kv_shm"))
            except StatecoreError:
                advert = None
            same = advert is not None and await trio.to_thread.run_sync(kv_shm.same_host, advert)
            self._inboxes[node] = kv_shm.ShmInbox(advert.directory) if same and advert else None
        inbox = self._inboxes[node]
        if inbox is None and self.kv_transport == "shm":
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_SHM_GONE,
                                           f"{node} offers no shared memory this node can map "
                                           "(--kv-transport shm)"))
        return inbox


__all__ = ["InfoDocument", "KvSources"]
