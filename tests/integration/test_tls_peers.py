"""Node-to-node calls over TLS, on real sockets: one node served by hypercorn over HTTPS (with the
certificate a throwaway CA signed for 127.0.0.1) and one over plain HTTP. `HttpxPeers` trusting
that CA probes the https node and pulls megabytes of KV from it through `kv_pull`, byte for byte,
and talks to the plain node with the same object (the URL's scheme decides); one trusting another
CA, or only the system store, is refused at the handshake with a typed `transport_lost` that
names the certificate; a plain-http call to the TLS port gets no answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trustme
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.http.peers_httpx import HttpxPeers
from adapters.serve.listeners import listener_url, open_listener
from adapters.serve.node import hypercorn_config
from adapters.tls import TlsFiles, certificate_refused, client_context
from statecore.errors import Code, StatecoreError
from statecore.ids import RequestId

KV = bytes(range(256)) * (3 * 4096 + 7)  # a little over 3 MiB: many TLS records, an odd tail


async def _health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def _kv(request: Request) -> Response:
    return Response(KV, media_type="application/octet-stream")


APP = Starlette(routes=[Route("/health", _health), Route("/internal/kv/{rid}", _kv)])


@dataclass
class Nodes:
    https: str
    http: str
    ca: str
    other_ca: str


@pytest.fixture
async def nodes(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Nodes]:
    ca, other = trustme.CA(), trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "other", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    other.cert_pem.write_to_path(paths["other"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    stop = trio.Event()
    urls = []
    for tls in (TlsFiles(paths["cert"], paths["key"]), TlsFiles()):
        listener = open_listener("127.0.0.1", 0)
        urls.append(listener_url(listener, https=tls.serves_https))
        config = hypercorn_config(listener, tls)
        await nursery.start(lambda task_status, c=config: serve(
            APP, c, shutdown_trigger=stop.wait, task_status=task_status))  # type: ignore[arg-type]
    assert urls[0].startswith("https://") and urls[1].startswith("http://")
    yield Nodes(urls[0], urls[1], paths["ca"], paths["other"])
    stop.set()


async def test_a_peer_trusting_the_ca_probes_and_pulls_over_tls_and_plain_http_alike(nodes: Nodes) -> None:
    peers = HttpxPeers(ssl_context=client_context(nodes.ca))
    try:
        assert await peers.health(nodes.https) and await peers.health(nodes.http)
        for node in (nodes.https, nodes.http):
            pulled = await peers.fetch_kv(node, RequestId("r1"))
            assert len(pulled) == len(KV) and bytes(pulled) == KV, node
            del pulled  # its receive buffer may serve the next pull
    finally:
        await peers.aclose()


@pytest.mark.parametrize("trusts", ["another CA", "the system store"])
async def test_a_peer_not_trusting_the_ca_is_refused_at_the_handshake(nodes: Nodes, trusts: str) -> None:
    peers = HttpxPeers(ssl_context=client_context(nodes.other_ca if trusts == "another CA" else None))
    try:
        assert not await peers.health(nodes.https)
        assert await peers.health(nodes.http)  # plain http needs no certificate
        with pytest.raises(StatecoreError) as pull:
            await peers.fetch_kv(nodes.https, RequestId("r2"))
        assert pull.value.info.code is Code.TRANSPORT_LOST
        assert certificate_refused(pull.value) is not None, repr(pull.value.__cause__)
        with pytest.raises(StatecoreError) as call:
            await peers.info(nodes.https)
        assert call.value.info.code is Code.TRANSPORT_LOST and certificate_refused(call.value) is not None
    finally:
        await peers.aclose()


async def test_plain_http_to_the_tls_port_gets_no_answer(nodes: Nodes) -> None:
    plain = nodes.https.replace("https://", "http://")
    peers = HttpxPeers(ssl_context=client_context(nodes.ca))
    try:
        assert not await peers.health(plain)
        with pytest.raises(StatecoreError) as pull:
            await peers.fetch_kv(plain, RequestId("r3"))
        assert pull.value.info.code is Code.TRANSPORT_LOST and certificate_refused(pull.value) is None
        assert await peers.health(nodes.https)  # the TLS node still serves
    finally:
        await peers.aclose()
