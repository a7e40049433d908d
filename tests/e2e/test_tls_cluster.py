"""TLS on every node of a real cluster: `statecore run` with a certificate for 127.0.0.1 that a
throwaway CA signed starts router, prefill and decode over HTTPS (its own health waits verify
them against that CA), a completion through the router works for a client trusting the CA, its
KV really moved from the prefill node to the decode node over TLS (both ends' metrics agree), a
plain-http request to any node's port gets no answer, and a client that does not trust the CA is
refused; the cluster then drains and exits 0."""

from __future__ import annotations

import re
import ssl
import time
from pathlib import Path

import httpx
import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families

from adapters.serve.cluster import HANDOFF_PROMPT, wait_healthy
from adapters.tls import certificate_refused, client_context
from tests.e2e.harness import Node

pytestmark = pytest.mark.e2e


def kv_bytes(url: str, direction: str, verify: ssl.SSLContext) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5.0, verify=verify).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "statecore:kv_transfer_bytes_total" and sample.labels["direction"] == direction:
                return float(sample.value)
    raise AssertionError(f"{url}/metrics has no kv_transfer_bytes_total{{direction={direction!r}}}")


def test_a_cluster_with_tls_on_every_node(tmp_path: Path) -> None:
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    ca_file, cert, key = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    trusted = client_context(str(ca_file))
    cluster = Node("cluster", ["--tls-certfile", str(cert), "--tls-keyfile", str(key), "--tls-ca-file",
                               str(ca_file), "--force-disaggregation"], tmp_path / "cluster.log")
    router = f"https://127.0.0.1:{cluster.port}"
    cluster.start()
    try:
        assert cluster.process is not None
        problem = wait_healthy(router, cluster.process, 120.0, verify=trusted)
        assert problem is None, f"{problem}:\n{cluster.tail()}"
        deadline = time.monotonic() + 30
        while (banner := re.search(r"cluster ready: router (\S+) +\(prefill (\S+), decode (\S+)\)",
                                   cluster.log.read_text())) is None:
            assert time.monotonic() < deadline and cluster.process.poll() is None, cluster.tail()
            time.sleep(0.1)
        assert banner[1] == router and all(url.startswith("https://127.0.0.1:") for url in banner.groups())
        prefill, decode = banner[2], banner[3]

        body = {"model": "demo_model", "max_tokens": 8,
                "messages": [{"role": "user", "content": HANDOFF_PROMPT}]}
        reply = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60.0, verify=trusted)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0, reply.json()
        served, received = kv_bytes(prefill, "served", trusted), kv_bytes(decode, "received", trusted)
        assert served > 0 and served == received, (served, received)  # the decode node pulled over TLS

        for url in (router, prefill, decode):
            with pytest.raises(httpx.TransportError):  # the TLS port answers no plain HTTP
                httpx.get(url.replace("https://", "http://") + "/health", timeout=5.0)
        for verify in (True, client_context(None), client_context(str(_other_ca(tmp_path)))):
            with pytest.raises(httpx.ConnectError) as refused:
                httpx.get(f"{router}/health", timeout=5.0, verify=verify)
            assert certificate_refused(refused.value) is not None, refused.value
        assert httpx.get(f"{router}/health", timeout=5.0, verify=trusted).status_code == 200  # still serving
    finally:
        code = cluster.stop()
    assert code == 0, cluster.tail()
    assert "Traceback" not in cluster.log.read_text(), cluster.tail()


def _other_ca(tmp_path: Path) -> Path:
    path = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(path))
    return path
