"""`HttpxPeers`: the Peers port over httpx, node to node.

Every transport failure of an httpx call is translated here, in one place (httpx's own
map_httpcore_exceptions pattern): `httpx.TransportError` and a peer's early EOF become a
StatecoreError with Code.TRANSPORT_LOST; an HTTP error answer becomes the peer's typed error.
The client takes an injectable `transport=` so tests can use `httpx.MockTransport`. KV pulls,
a prefill node's pulls of a decode node's cached prefix (`fetch_prefix`) and streamed handoffs
go around httpx instead (`adapters.http.kv_receive`: the reads, their errors typed to the same
codes) unless a transport was injected. Where a decode node reads a prefill node's KV from is
`KvSources`' to know: the prefill node's KV plane (a socket of its own for KV bodies,
`adapters.kv.plane`) when this node can reach it, and its shared memory (`adapters.kv.shm_inbox`)
when its advert proves it is on this host, each probed once per prefill node from its
/internal/info (a plane connection that fails makes the next call probe again). Every received
KV body (a pull's, a streamed piece's) lands where `HttpxPeers.landing` says: process memory
(`kv_pull.ReceiveBuffers`), or the shared memory the node's engine core process reads
(`ProcessEngine.kv_landing`), so that no copy follows.
https:// peers are verified against one `ssl.SSLContext` (`adapters.tls.client_context`: the
node's `--tls-ca-file`, else the system store), for every call and the KV pulls alike; http://
peers stay plain. This module may import anything.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx
import pydantic
import trio

from adapters.http.internal_wire import (
    CACHED_TOKENS_PARAM,
    TOKEN_HEADER,
    DecodeBody,
    PrefillBody,
    PrefillReplyBody,
    PrefixFromBody,
    PrefixKvBody,
    PrefixSummaryBody,
    SamplingBody,
    error_from_json,
    info_from_json,
    parse_output_line,
)
from adapters.http.kv_receive import (
    pull_direct,
    raise_error_document,
    read_stream,
    stream_errors,
    with_deadline,
)
from adapters.kv import pull as kv_pull
from adapters.kv.shm_inbox import ShmInbox, same_host
from adapters.kv.shm_region import parse_advert
from adapters.tls import client_context
from effects.handoffs import HandoffLog
from effects.ports import (
    DecodeCall,
    DecodeMessage,
    KvBytes,
    KvSegment,
    ModelInfo,
    PrefillReply,
    PrefixSource,
    PrefixSummary,
    PulledPrefix,
    SamplingParams,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId
from statecore.policy import STOP

log = logging.getLogger("statecore.peers")

DEFAULT_MAX_KV_BYTES = 1 << 34
DEFAULT_KV_BUFFER_BYTES = 1 << 30  # receive buffers a decode node keeps for reuse
_JSON = {"content-type": "application/json"}  # a body sent already encoded


@contextlib.contextmanager
def transport_errors(node: str) -> Iterator[None]:
    """Map httpx's transport failures to TRANSPORT_LOST, naming the node. Every error of a call
    to `node` comes from it (`ErrorInfo.came_from`): the call is where it first reaches this node."""
    try:
        yield
    except StatecoreError as exc:
        if exc.info.origin is not None:
            raise
        raise StatecoreError(exc.info.came_from(node)) from exc
    except httpx.TimeoutException as exc:
        raise StatecoreError(
            ErrorInfo(Fault.TRANSPORT, Code.TIMEOUT, f"{node} timed out: {exc!r}", origin=node)
        ) from exc
    except (httpx.TransportError, httpx.StreamError) as exc:
        raise StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST,
                                       f"lost the connection to {node}: {exc!r}", origin=node)) from exc


def _told_when_sent(on_sent: Callable[[], object] | None) -> dict[str, object] | None:
    """A request's extensions that tell `on_sent` once its body has been written: httpcore's
    `trace` extension (a transport a test injects may tell it the same way)."""
    if on_sent is None:
        return None

    async def trace(event: str, info: dict[str, object]) -> None:
        if event.endswith("send_request_body.complete"):
            on_sent()

    return {"trace": trace}


async def _raise_for_error(node: str, response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    await response.aread()
    try:
        data: object = response.json()
    except ValueError:
        data = None
    info = error_from_json(data, response.status_code)
    raise StatecoreError(info)


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
        self.device_pieces: dict[str, bool] = {}  # by prefill node, probed with its inbox
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
                info = await self.info_document(node)
                advert = parse_advert(info.get("kv_shm"))
                # it sends pieces in GPU memory (`adapters.mlx.device_pieces`) to whoever asks
                self.device_pieces[node] = info.get("kv_device") is True
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


class HttpxPeers:
    def __init__(
        self,
        *,
        token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
        max_kv_bytes: int = DEFAULT_MAX_KV_BYTES,
        handoffs: HandoffLog | None = None,
        kv_buffer_bytes: int = DEFAULT_KV_BUFFER_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        prompt_tokens_details: bool = False,
        kv_transport: str = "auto",
    ) -> None:
        """`prompt_tokens_details` (a router with --enable-prompt-tokens-details): ask the nodes
        how many prompt tokens each prefill took from their prefix cache (`PrefillReply.cached_tokens`)."""
        headers = {TOKEN_HEADER: token} if token else {}
        self._details = {CACHED_TOKENS_PARAM: "1"} if prompt_tokens_details else None
        # what https:// peers are verified against (never nothing): the system store by default
        self._ssl_context = ssl_context if ssl_context is not None else client_context(None)
        # KV pulls skip httpx (see kv_pull) unless a test injected a transport to route them
        self._direct_kv = transport is None
        self._headers = list(headers.items())
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        self.client = httpx.AsyncClient(
            headers=headers, timeout=timeout, transport=transport, limits=limits, verify=self._ssl_context
        )
        self.max_kv_bytes = max_kv_bytes
        self.handoffs = handoffs  # a decode node's log: each KV pull's timings land there
        self.receive_buffers = kv_pull.ReceiveBuffers(kv_buffer_bytes)
        # where received KV bodies (a pull's, a stream's pieces) land: here, in process memory,
        # unless the node's engine core reads shared memory (`ProcessEngine.kv_landing`)
        self.landing: kv_pull.Landing = self.receive_buffers
        # this node's engine takes a streamed handoff's pieces in GPU memory (`ModelInfo.device_pieces`)
        self.takes_device_pieces = False
        # where a prefill node's KV is read from: its KV plane, its shared memory (`kv_transport`)
        self.kv_sources = KvSources(self.info_document, direct=self._direct_kv, kv_transport=kv_transport,
                                    connect_timeout_s=connect_timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def prefill(
        self, node: str, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        prefix_from: PrefixSource | None = None, *, attach_by: str | None = None,
        on_sent: Callable[[], object] | None = None,
    ) -> PrefillReply:
        # built unvalidated (`model_construct`): the values are the core's own, typed; the node
        # validates what arrives (a long prompt's ids validated here too cost ~0.7 ms at 8,000)
        body = PrefillBody.model_construct(request_id=request_id, prompt=list(prompt),
                                           sampling=SamplingBody.of(sampling),
                                           prefix_from=PrefixFromBody.of(prefix_from),
                                           kv_attach=attach_by is not None, kv_attach_by=attach_by)
        with transport_errors(node):
            response = await self.client.post(f"{node}/internal/prefill", content=body.encoded(),
                                              headers=_JSON, params=self._details,
                                              extensions=_told_when_sent(on_sent))
            await _raise_for_error(node, response)
            try:
                reply = PrefillReplyBody.model_validate_json(response.content)
            except ValueError as exc:
                raise StatecoreError(
                    ErrorInfo(Fault.PEER, Code.PEER_FAILED, f"{node} sent a malformed prefill reply")
                ) from exc
        return reply.reply()

    async def decode(self, node: str, call: DecodeCall) -> AsyncIterator[DecodeMessage]:
        body = DecodeBody.model_construct(  # unvalidated, as `prefill`'s
            request_id=call.request_id,
            prompt=list(call.prompt),
            sampling=SamplingBody.of(call.sampling),
            first_token=call.first_token,
            prefill_url=call.prefill_url,
            kv_stream=call.kv_stream,
            prefix_from=PrefixFromBody.of(call.prefix_from),
            kv_attach=call.kv_attach,
        )
        with transport_errors(node):
            async with self.client.stream(
                "POST", f"{node}/internal/decode", content=body.encoded(), headers=_JSON,
                params=self._details,
            ) as response:
                await _raise_for_error(node, response)
                async for line in response.aiter_lines():
                    if line:
                        message = parse_output_line(line.encode())
                        # the node's error comes from it, unless it passes on another's
                        yield message.came_from(node) if isinstance(message, ErrorInfo) else message

    async def prefill_stream(
        self, node: str, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        prefix_from: PrefixSource | None = None, *, layers: int, attach: bool = False,
    ) -> AsyncGenerator[KvSegment | PrefillReply, None]:
        inbox = await self.kv_sources.inbox(node)
        body = PrefillBody.model_construct(  # unvalidated, as `prefill`'s
            request_id=request_id, prompt=list(prompt), sampling=SamplingBody.of(sampling),
            prefix_from=PrefixFromBody.of(prefix_from), kv_shm=inbox is not None, kv_attach=attach,
            kv_device=(inbox is not None and self.takes_device_pieces
                       and self.kv_sources.device_pieces.get(node, False)))
        url = await self.kv_sources.on_plane(node, f"{node}/internal/prefill_stream")
        if self.handoffs is not None:
            self.handoffs.record(request_id).transport = ("http" if inbox is None else
                                                          "gpu" if body.kv_device else "shm")
        document = body.encoded()
        # No cancel scope may span a yield of this generator: each read has its own deadline.
        with stream_errors(node), self.kv_sources.plane_watched(node):
            if self._direct_kv and url.startswith(("http://", "https://")):
                async with kv_pull.open_stream(url, self._headers, document,
                                               connect_timeout_s=self._connect_timeout_s,
                                               ssl_context=self._ssl_context) as (status, answer):
                    if not isinstance(answer, kv_pull.StreamBody):
                        raise_error_document(status, answer)
                    else:
                        read_into = with_deadline(answer.read_into, self._read_timeout_s)
                        async for item in read_stream(read_into, len(prompt), layers, inbox, self.landing,
                                                      self.max_kv_bytes):
                            yield item
            else:
                async for item in self._stream_httpx(node, url, document, len(prompt), layers, inbox):
                    yield item

    async def _stream_httpx(self, node: str, url: str, document: bytes, prompt_tokens: int, layers: int,
                            inbox: ShmInbox | None) -> AsyncIterator[KvSegment | PrefillReply]:
        """The stream through httpx (a test's injected transport): its bytes through a small
        buffer, read as `read_into` asks."""
        with transport_errors(node):
            async with self.client.stream("POST", url, content=document,
                                          headers={"content-type": "application/json"}) as response:
                await _raise_for_error(node, response)
                chunks = response.aiter_raw()
                pending = bytearray()

                async def read_into(view: memoryview) -> None:
                    while len(pending) < len(view):
                        try:
                            pending.extend(await chunks.__anext__())
                        except StopAsyncIteration:
                            raise kv_pull.KvStreamCut("the KV stream ended early") from None
                    view[:] = pending[: len(view)]
                    del pending[: len(view)]

                async for item in read_stream(read_into, prompt_tokens, layers, inbox, self.landing,
                                              self.max_kv_bytes):
                    yield item

    async def fetch_kv(self, node: str, request_id: RequestId) -> KvBytes:
        url = await self.kv_sources.on_plane(node, f"{node}/internal/kv/{request_id}")
        with self.kv_sources.plane_watched(node):
            payload, head_s, last_byte_s = await self._pull(node, url)
        if self.handoffs is not None:
            record = self.handoffs.record(request_id)
            record.wire_bytes = len(payload)
            record.first_byte_s = head_s
            record.transfer_s = last_byte_s
            record.body_s = last_byte_s - head_s
        return payload

    async def fetch_prefix(self, node: str, tokens: Sequence[int]) -> PulledPrefix:
        body = PrefixKvBody(tokens=list(tokens)).model_dump_json().encode()
        payload, head_s, last_byte_s = await self._pull(node, f"{node}/internal/prefix_kv", body)
        return PulledPrefix(payload, head_s, last_byte_s)

    async def _pull(self, node: str, url: str, json_body: bytes | None = None
                    ) -> tuple[KvBytes, float, float]:
        """A KV payload (GET, or POST of `json_body`): its bytes, seconds to the head and to the
        last byte; over kv_pull unless a test injected a transport."""
        if self._direct_kv and url.startswith(("http://", "https://")):
            pulled = await pull_direct(node, url, self._headers, max_kv_bytes=self.max_kv_bytes,
                                       connect_timeout_s=self._connect_timeout_s,
                                       read_timeout_s=self._read_timeout_s, landing=self.landing,
                                       ssl_context=self._ssl_context, json_body=json_body)
            return pulled.body, pulled.head_s, pulled.last_byte_s
        return await self._pull_httpx(node, url, json_body)

    async def _pull_httpx(self, node: str, url: str, json_body: bytes | None = None
                          ) -> tuple[bytes, float, float]:
        chunks: list[bytes] = []
        size = 0
        method = "GET" if json_body is None else "POST"
        headers = None if json_body is None else {"content-type": "application/json"}
        with transport_errors(node):
            started = time.perf_counter()
            async with self.client.stream(method, url, content=json_body, headers=headers) as response:
                head = time.perf_counter()
                await _raise_for_error(node, response)
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_kv_bytes:
                        raise StatecoreError(
                            ErrorInfo(Fault.PEER, Code.KV_TOO_LARGE, f"KV from {node} exceeds the limit")
                        )
                    chunks.append(chunk)
                last_byte = time.perf_counter()
        return b"".join(chunks), head - started, last_byte - started

    async def release_kv(self, node: str, request_id: RequestId) -> None:
        with transport_errors(node):
            response = await self.client.delete(f"{node}/internal/kv/{request_id}")
            if response.status_code not in (200, 404):
                await _raise_for_error(node, response)

    async def cancel(self, node: str, request_id: RequestId, *, finish_reason: str | None = None) -> None:
        # `stopped` too, for a node of an older version during a rolling upgrade
        params = {"stopped": "1" if finish_reason == STOP else "0"}
        if finish_reason is not None:
            params["finished"] = finish_reason
        with transport_errors(node):
            await self.client.post(f"{node}/internal/cancel/{request_id}", params=params)

    async def health(self, node: str) -> bool:
        try:
            response = await self.client.get(f"{node}/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def info(self, node: str) -> ModelInfo:
        return info_from_json(await self.info_document(node))

    async def info_document(self, node: str) -> dict[str, object]:
        """A node's whole /internal/info, fields beyond `ModelInfo` (its BLAS) included."""
        with transport_errors(node):
            response = await self.client.get(f"{node}/internal/info", timeout=5.0)
            await _raise_for_error(node, response)
            try:
                doc = response.json()
            except ValueError:
                doc = None
        if not isinstance(doc, dict):
            raise StatecoreError(
                ErrorInfo(Fault.PEER, Code.PEER_FAILED, f"{node} sent a malformed model info")
            )
        return doc

    async def prefix_summary(self, node: str, since: int | None) -> PrefixSummary | None:
        params = {} if since is None else {"since": str(since)}
        with transport_errors(node):
            response = await self.client.get(f"{node}/internal/prefix", params=params, timeout=5.0)
            await _raise_for_error(node, response)
            try:
                return PrefixSummaryBody.model_validate_json(response.content).summary()
            except (ValueError, pydantic.ValidationError) as exc:
                raise StatecoreError(ErrorInfo(
                    Fault.PEER, Code.PEER_FAILED, f"{node} sent a malformed prefix summary: {exc}")) from exc

    async def stats(self, node: str) -> dict[str, object]:
        with transport_errors(node):
            response = await self.client.get(f"{node}/internal/stats", timeout=5.0)
            await _raise_for_error(node, response)
            data: dict[str, object] = response.json()
            return data


__all__ = ["HttpxPeers", "InfoDocument", "KvSources", "transport_errors"]
