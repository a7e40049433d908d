"""How a decode node reads a prefill node's KV: where from, and the reads that bypass httpx.

Where from is `KvSources`' to know: the prefill node's KV plane (a socket of its own for KV
bodies, `adapters.kv.plane`) when this node can reach it, and its shared memory
(`adapters.kv.shm_inbox`) when its advert proves it is on this host, each probed once per prefill
node from its /internal/info (a plane connection that fails makes the next call probe again).
The reads: a streamed handoff's records become the Peers port's items (`read_stream`: each piece
checked by the stream's own rules, its body received where the node's landing says, a piece in
shared memory read in place), and a pulled payload comes straight into one buffer (`pull_direct`,
over `adapters.kv.pull`). Their failures are translated here, in one place, as `HttpxPeers`
translates httpx's: a cut stream is `kv_truncated`, a lost socket `transport_lost`, a slow one
`timeout`, a peer's error answer its typed error. `adapters.http.peers_httpx` calls these; its
httpx paths (a test's injected transport) read a stream through `read_stream` too. This module
imports trio; it must never import httpx (the reads here go around it), mlx or mlx_lm.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import NoReturn
from urllib.parse import urlsplit, urlunsplit

import h11
import pydantic
import trio

from adapters.http.internal_wire import PrefillReplyBody, error_from_json
from adapters.kv import pull as kv_pull
from adapters.kv import stream as kv_stream
from adapters.kv.shm_inbox import ShmInbox, same_host
from adapters.kv.shm_region import default_directory, parse_advert, parse_ref
from effects.ports import KvPieces, KvSegment, PrefillReply
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = ["InfoDocument", "KvSources", "pull_direct", "raise_error_document", "read_stream", "stream_errors",
           "with_deadline"]

log = logging.getLogger("statecore.peers")

InfoDocument = Callable[[str], Awaitable[dict[str, object]]]


class KvSources:
    """A decode node's knowledge of its prefill nodes' KV planes and shared memory (`HttpxPeers`'
    own: where it reads KV from)."""

    def __init__(self, info_document: InfoDocument, *, direct: bool, kv_transport: str,
                 connect_timeout_s: float) -> None:
        self.info_document = info_document  # a node's whole /internal/info
        # KV bodies are read directly (`adapters.kv.pull`), not through a transport a test injected
        self.direct = direct
        # "auto" maps a prefill node's shared memory when its advert proves it is on this host,
        # "http" never does, "shm" insists (KV_SHM_GONE if not)
        self.kv_transport = kv_transport
        self.connect_timeout_s = connect_timeout_s
        self._inboxes: dict[str, ShmInbox | None] = {}  # by prefill node, once probed
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

    async def inbox(self, node: str) -> ShmInbox | None:
        """The prefill node's shared memory, mapped here, when `kv_transport` allows it and the
        node's advert (its /internal/info) proves it is on this host; probed once per node."""
        if self.kv_transport == "http":
            return None
        if node not in self._inboxes:
            try:
                advert = parse_advert((await self.info_document(node)).get("kv_shm"))
            except StatecoreError:
                advert = None
            same = advert is not None and await trio.to_thread.run_sync(same_host, advert)
            self._inboxes[node] = ShmInbox(advert.directory) if same and advert else None
        inbox = self._inboxes[node]
        if inbox is None and self.kv_transport == "shm":
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_SHM_GONE,
                                           f"{node} offers no shared memory this node can map "
                                           "(--kv-transport shm)"))
        return inbox


@contextlib.contextmanager
def stream_errors(node: str) -> Iterator[None]:
    """A KV stream's failures as typed errors named after the node (so the router, hearing of it
    through the decode node, blames the right one)."""
    try:
        yield
    except StatecoreError as exc:
        if node in exc.info.message:
            raise
        raise StatecoreError(replace(exc.info, message=f"{node}: {exc.info.message}")) from exc
    except kv_pull.KvStreamCut as exc:
        raise StatecoreError(ErrorInfo(
            Fault.PEER, Code.KV_TRUNCATED, f"the KV stream from {node} was cut: {exc}")) from exc
    except trio.TooSlowError as exc:
        raise StatecoreError(
            ErrorInfo(Fault.TRANSPORT, Code.TIMEOUT, f"{node} timed out streaming the KV")) from exc
    except (OSError, trio.BrokenResourceError, h11.ProtocolError, kv_pull.KvPullError) as exc:
        raise StatecoreError(ErrorInfo(
            Fault.TRANSPORT, Code.TRANSPORT_LOST, f"lost the KV stream from {node}: {exc!r}")) from exc


def raise_error_document(status: int, body: bytes) -> NoReturn:
    """A peer's error answer (a small JSON document) as its typed error."""
    try:
        data: object = json.loads(body)  # an error document: small
    except ValueError:
        data = None
    raise StatecoreError(error_from_json(data, status))


def with_deadline(read_into: kv_stream.ReadInto, seconds: float) -> kv_stream.ReadInto:
    """`read_into` that raises TooSlowError when one read takes longer than `seconds`."""
    async def read(view: memoryview) -> None:
        with trio.fail_after(seconds):
            await read_into(view)
    return read


async def read_stream(read_into: kv_stream.ReadInto, prompt_tokens: int, layers: int, inbox: ShmInbox | None,
                      landing: kv_pull.Landing, max_kv_bytes: int
                      ) -> AsyncGenerator[KvSegment | PrefillReply, None]:
    """A KV stream's records as the Peers port's items, each body received into `landing`; the
    stream's own checks on the way."""
    await kv_stream.read_preamble(read_into)
    coverage = kv_stream.SegmentCoverage(layers, prompt_tokens)
    taken: list[memoryview] = []

    def take(nbytes: int) -> memoryview:
        taken.append(landing.take(nbytes))
        return taken[-1]

    while True:
        try:
            record = await kv_stream.read_record(read_into, take, max_kv_bytes)
        except BaseException:
            for view in taken:  # a piece cut mid-body
                landing.give_back(view)
            raise
        finally:
            taken.clear()
        match record:
            case kv_stream.Segment(where=where, payload=payload):
                coverage.add(where)
                yield KvSegment(where.start, where.stop, where.first_layer, where.end_layer,
                                KvPieces((payload,)), record.last_step_started)
            case kv_stream.SharedSegment(where=where, reference=reference):
                if inbox is None:
                    raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                                   "a piece in shared memory nobody asked for"))
                coverage.add(where)
                ref = parse_ref(reference)
                view = await trio.to_thread.run_sync(inbox.read, ref)
                # the caller builds its arrays from the view before asking for the next piece;
                # an engine core process reads the region itself (where it looks for regions)
                here = inbox.directory == default_directory()
                yield KvSegment(where.start, where.stop, where.first_layer, where.end_layer,
                                KvPieces((view,), shared=ref if here else None), record.last_step_started)
                inbox.done(ref)  # raises when the region changed under the copy
            case kv_stream.Document(kind=kv_stream.FIRST_TOKEN, raw=raw):
                try:
                    reply = PrefillReplyBody.model_validate_json(raw)
                except pydantic.ValidationError as exc:
                    raise StatecoreError(ErrorInfo(
                        Fault.PEER, Code.KV_MALFORMED,
                        f"a malformed first token in the KV stream: {exc}")) from exc
                yield reply.reply()
            case kv_stream.Document(value=value):  # the prefill node's error
                raise StatecoreError(error_from_json(value, 502))
            case kv_stream.StreamEnd():
                coverage.finish(record)
                return


async def pull_direct(node: str, url: str, headers: Sequence[tuple[str, str]], *, max_kv_bytes: int,
                      connect_timeout_s: float, read_timeout_s: float, landing: kv_pull.Landing,
                      ssl_context: ssl.SSLContext, json_body: bytes | None = None) -> kv_pull.PulledKv:
    """A KV payload (GET, or POST of `json_body`) over `adapters.kv.pull`, straight into one
    buffer of `landing`, its failures typed as `stream_errors` types a stream's."""
    try:
        with trio.fail_after(read_timeout_s):
            pulled = await kv_pull.pull(url, headers, max_bytes=max_kv_bytes,
                                        connect_timeout_s=connect_timeout_s,
                                        buffers=landing, ssl_context=ssl_context,
                                        json_body=json_body)
    except kv_pull.KvTooLarge as exc:
        raise StatecoreError(
            ErrorInfo(Fault.PEER, Code.KV_TOO_LARGE, f"KV from {node} exceeds the limit: {exc}")
        ) from exc
    except trio.TooSlowError as exc:
        raise StatecoreError(
            ErrorInfo(Fault.TRANSPORT, Code.TIMEOUT, f"{node} timed out sending the KV")
        ) from exc
    except (OSError, trio.BrokenResourceError, h11.ProtocolError, kv_pull.KvPullError) as exc:
        raise StatecoreError(
            ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, f"lost the connection to {node}: {exc!r}")
        ) from exc
    if pulled.status >= 400:
        raise_error_document(pulled.status, bytes(pulled.body))
    return pulled
