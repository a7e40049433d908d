"""Failure is per request, proven on a real 1 prefill + 2 decode cluster.

Every fault phase is injected for one marked request while good requests run beside it: the
marked one ends with a clear typed error (streaming: an error event, then [DONE]), the others
complete with the single node's bytes, every loop stays alive, and every node's live counts
return to zero. Also: a sample of hostile bodies, garbage KV, cancellation, the internal token.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from effects.faults import ENABLE_ENV, Phase
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import Cluster, Node, assert_no_leaks, post, start_cluster, without_ids
from tests.request_bodies import VIOLATIONS, assert_openai_error, assert_well_formed, bodies, valid_calls

pytestmark = pytest.mark.e2e

TOKEN = "t0ps3cret"
MAX_KV_BYTES = 1 << 20  # far above what these prompts need
# A marked stall, and how long a client waits before it gives up during it: the client must
# still be waiting when its request reaches the stall (a prefill of a short prompt, even on a
# busy 2-core machine), and give up well before the stall ends.
STALL_S = 5.0
GIVE_UP_S = 2.5
GOOD = {"prompt": "The harbour lights came on one by one.", "max_tokens": 12, "temperature": 0}
# which error code each injected phase must surface as
EXPECTED_CODE = {
    Phase.INTAKE: {"injected_fault"},
    Phase.TOKENIZE: {"injected_fault"},
    Phase.PREFILL: {"injected_fault"},
    Phase.KV_ENCODE: {"injected_fault"},
    Phase.SEND_HEADER: {"kv_truncated"},
    Phase.MID_BODY: {"kv_truncated"},
    Phase.CHECKSUM: {"kv_checksum_mismatch"},
    Phase.INSTALL: {"injected_fault"},
    Phase.DECODE_STEP: {"injected_fault"},
    Phase.STREAM_OUT: {"transport_lost"},
}
MATRIX = list(EXPECTED_CODE)  # DEVICE_CRASH ends a node's loop: test_node_loss_and_drain covers it
# The same phases failing with a plain RuntimeError (a bug's shape, not a typed error): which
# error code the client sees then.
UNTYPED = {
    Phase.INTAKE: {"internal_error"},
    Phase.TOKENIZE: {"internal_error"},
    Phase.PREFILL: {"internal_error"},
    Phase.KV_ENCODE: {"internal_error"},
    Phase.INSTALL: {"internal_error"},
    Phase.DECODE_STEP: {"internal_error"},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    faults: list[str] = []
    for phase in MATRIX:
        faults += ["--inject-fault", phase.value]
    faults += ["--inject-fault", f"kv_encode:slow={STALL_S}", "--inject-fault", f"prefill:slow={STALL_S}"]
    for batch_fault in (Phase.DECODE_CALL_ONCE, Phase.DECODE_CALL_ALWAYS):
        faults += ["--inject-fault", batch_fault.value]
    for phase in UNTYPED:
        faults += ["--inject-fault", f"{phase.value}:untyped"]
    with pytest.MonkeyPatch.context() as env:  # the nodes' fault flags arm only with it
        env.setenv(ENABLE_ENV, "1")
        built = start_cluster(
            cached_checkpoint("llama"), tmp_path_factory.mktemp("logs-faults"), prefills=1, decodes=2,
            node_args=("--internal-token", TOKEN, "--max-kv-bytes", str(MAX_KV_BYTES), *faults),
            router_args=("--force-disaggregation", "--internal-token", TOKEN, *faults),
        )
    try:
        yield built
    finally:
        built.stop()


def _call(node: Node, body: dict[str, Any], request_id: str, stream: bool) -> tuple[int, list[Any]]:
    """(status, parsed pieces): the JSON body, or the SSE data payloads."""
    headers = {"x-request-id": request_id}
    if not stream:
        r = httpx.post(f"{node.url}/v1/completions", json=body, headers=headers, timeout=60)
        return r.status_code, [r.json()]
    pieces: list[Any] = []
    with httpx.stream("POST", f"{node.url}/v1/completions", json={**body, "stream": True},
                      headers=headers, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                pieces.append(data if data == "[DONE]" else json.loads(data))
    return 200, pieces


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(("phase", "untyped"), [(p, False) for p in MATRIX] + [(p, True) for p in UNTYPED],
                         ids=lambda v: v.value if isinstance(v, Phase) else "untyped" if v else "typed")
def test_fault_fails_one_request_only(cluster: Cluster, phase: Phase, untyped: bool, stream: bool) -> None:
    expected_good = without_ids(post(cluster.single, "/v1/completions", GOOD).json())
    kind = "untyped-" if untyped else ""
    marked = f"inject-fault-{kind}{phase.value}-{'s' if stream else 'j'}"
    with ThreadPoolExecutor(4) as pool:
        bad = pool.submit(_call, cluster.router, {**GOOD, "max_tokens": 8}, marked, stream)
        goods = [pool.submit(_call, cluster.router, GOOD, f"good-{phase.value}-{i}-{stream}", False)
                 for i in range(3)]
        status, pieces = bad.result()
        for good in goods:
            good_status, good_pieces = good.result()
            assert good_status == 200 and without_ids(good_pieces[0]) == expected_good
    if status != 200:  # failed before any output: an HTTP error in OpenAI's shape
        error = pieces[0]["error"]
        assert 400 <= status < 600 and status != 200
    else:  # failed after output began (streaming): an error event, then [DONE]
        assert stream, pieces
        assert pieces[-1] == "[DONE]" and "error" in pieces[-2], pieces
        error = pieces[-2]["error"]
    assert error["code"] in (UNTYPED if untyped else EXPECTED_CODE)[phase], error
    assert error["message"]
    assert_no_leaks(cluster.nodes[1:])  # the router and the three nodes of the cluster
    for node in cluster.nodes:
        assert httpx.get(f"{node.url}/health", timeout=5).status_code == 200
    assert post(cluster.router, "/v1/completions", GOOD).status_code == 200  # the next one succeeds


def _error_of(status: int, pieces: list[Any], stream: bool) -> dict[str, Any]:
    """The OpenAI-shaped error a failed call carried: its HTTP body, or (once output began) its
    last event before [DONE]."""
    if status != 200:
        assert 400 <= status < 600, status
        error: dict[str, Any] = pieces[0]["error"]
        return error
    assert stream and pieces[-1] == "[DONE]" and "error" in pieces[-2], pieces
    error = pieces[-2]["error"]
    return error


def _text(status: int, pieces: list[Any], stream: bool) -> str:
    assert status == 200, pieces
    if not stream:
        text: str = pieces[0]["choices"][0]["text"]
        return text
    assert pieces[-1] == "[DONE]" and not any("error" in p for p in pieces[:-1]), pieces
    return "".join(p["choices"][0]["text"] for p in pieces[:-1] if p["choices"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("through", ["single", "cluster"])
def test_a_failing_batch_step_fails_only_its_culprit(cluster: Cluster, through: str, stream: bool) -> None:
    """An untyped error inside a decode step's model call: raised once (transient), no request
    fails; raised every time one row is in the call (poisoned), only that request fails."""
    entry = cluster.single if through == "single" else cluster.router
    decoders = [cluster.single] if through == "single" else cluster.decode
    before = [node.stats() for node in decoders]
    expected = post(cluster.single, "/v1/completions", GOOD).json()["choices"][0]["text"]
    tag = f"{through}-{'s' if stream else 'j'}"
    with ThreadPoolExecutor(5) as pool:
        transient = pool.submit(_call, entry, GOOD, f"inject-fault-decode_call_once-{tag}", stream)
        poisoned = pool.submit(_call, entry, GOOD, f"inject-fault-decode_call_always-{tag}", stream)
        goods = [pool.submit(_call, entry, GOOD, f"good-batch-{tag}-{i}", stream) for i in range(3)]
        assert _text(*transient.result(), stream) == expected
        for good in goods:
            assert _text(*good.result(), stream) == expected
        error = _error_of(*poisoned.result(), stream)
    assert error["code"] == "engine_failed" and "decode_call_always" in error["message"], error
    after = [node.stats() for node in decoders]
    grew = {key: sum(a[key] - b[key] for a, b in zip(after, before, strict=True))
            for key in ("engine_step_retries", "engine_rows_isolated")}
    # At least one retry: two when the transient and the poisoned row raised in separate steps.
    assert grew["engine_rows_isolated"] == 1 and grew["engine_step_retries"] >= 1, grew
    assert_no_leaks([entry, *decoders])
    for node in decoders:
        assert node.stats()["bugs"] == 0
        assert httpx.get(f"{node.url}/health", timeout=5).status_code == 200


def test_client_disconnect_frees_the_decode_slot_before_its_request_would_end(cluster: Cluster) -> None:
    """The slot is freed because the client left, not because the request ran out: the decode
    node counts it cancelled, not done (3,000 tokens take far longer than the wait here)."""
    body = {"prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    before = [node.stats()["outcomes"] for node in cluster.decode]
    with httpx.stream("POST", f"{cluster.router.url}/v1/completions", json=body, timeout=60) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 10:  # still reading: the request is decoding on one node
                assert sum(node.stats()["decoding"] for node in cluster.decode) == 1
                break  # leaving the stream disconnects the client
    deadline = time.monotonic() + 30
    while sum(node.stats()["decoding"] for node in cluster.decode) > 0:
        assert time.monotonic() < deadline, "decode slot still held after the disconnect"
        time.sleep(0.02)
    after = [node.stats()["outcomes"] for node in cluster.decode]
    moved = {key: sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before, strict=True))
             for key in ("cancelled", "done")}
    assert moved == {"cancelled": 1, "done": 0}, moved
    assert_no_leaks(cluster.nodes[1:])


def test_cancel_mid_handoff_leaves_nothing_held(cluster: Cluster) -> None:
    """The prefill node stalls before sending the KV; the client leaves meanwhile."""
    outcome: list[BaseException] = []

    def client() -> None:
        try:
            httpx.post(f"{cluster.router.url}/v1/completions", json=GOOD, timeout=GIVE_UP_S,
                       headers={"x-request-id": "inject-fault-slow-kv_encode-1"})
        except httpx.ReadTimeout as exc:
            outcome.append(exc)

    ended = _ended(cluster.prefill[0])
    thread = threading.Thread(target=client)
    thread.start()
    while cluster.prefill[0].stats()["held_caches"] != 1:  # the handoff is under way
        assert thread.is_alive(), "the KV was not held before the client gave up"
        time.sleep(0.01)
    thread.join()
    assert outcome, "the client should have given up mid-handoff"
    _wait_until_ended(cluster.prefill[0], ended + 1)  # the stalled encode finished into a cancel
    assert_no_leaks(cluster.nodes[1:], timeout_s=5)


def test_client_gone_during_prefill_frees_everything(cluster: Cluster) -> None:
    ended = _ended(cluster.prefill[0])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.router.url}/v1/completions", json=GOOD, timeout=GIVE_UP_S,
                   headers={"x-request-id": "inject-fault-slow-prefill-1"})
    _wait_until_ended(cluster.prefill[0], ended + 1)  # the stalled prefill ended on its node
    assert_no_leaks(cluster.nodes[1:], timeout_s=5)


def _ended(node: Node) -> int:
    """How many requests the node's loop has seen end, whatever their terminal state."""
    outcomes: dict[str, int] = node.stats()["outcomes"]
    return sum(outcomes.values())


def _wait_until_ended(node: Node, count: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _ended(node) < count:
        assert time.monotonic() < deadline, f"{node.role} never ended {count} requests"
        time.sleep(0.05)


def test_internal_endpoints_require_the_token(cluster: Cluster) -> None:
    node = cluster.decode[0]
    assert httpx.get(f"{node.url}/internal/stats", timeout=5).status_code == 401
    body = {"request_id": "x", "prompt": [1, 2], "sampling": {"max_tokens": 2}}
    assert httpx.post(f"{node.url}/internal/decode", json=body, timeout=5).status_code == 401
    assert httpx.get(f"{node.url}/internal/stats", headers={"x-statecore-token": TOKEN},
                     timeout=5).status_code == 200


class _KvServer(ThreadingHTTPServer):
    payload = b""


class _KvHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        payload = self.server.payload  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_DELETE(self) -> None:
        self.send_response(200)
        self.end_headers()

    do_POST = do_DELETE

    def log_message(self, *args: object) -> None:
        pass


def _wrong_model_payload() -> bytes:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from adapters.kv.codec import encode_cache

    cache = KVCache()  # type: ignore[no-untyped-call]
    cache.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))  # type: ignore[no-untyped-call]
    return b"".join(encode_cache([cache, cache], fingerprint="some-other-model", token_count=3))


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\x00garbage" * 100, {"kv_malformed"}),
        (b"", {"kv_truncated", "kv_malformed"}),
        (None, {"kv_wrong_model"}),
        (b"\x89SCKV" + b"\x00" * (2 * MAX_KV_BYTES), {"kv_too_large"}),
    ],
    ids=["garbage", "empty", "wrong-model", "oversized"],
)
def test_bad_kv_payloads_are_refused_with_nothing_installed(
    cluster: Cluster, payload: bytes | None, code: set[str]
) -> None:
    server = _KvServer(("127.0.0.1", 0), _KvHandler)
    server.payload = payload if payload is not None else _wrong_model_payload()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        decode = cluster.decode[0]
        body = {"request_id": f"bad-kv-{len(server.payload)}", "prompt": [5, 6, 7],
                "sampling": {"max_tokens": 4}, "first_token": 9,
                "prefill_url": f"http://127.0.0.1:{server.server_address[1]}"}
        r = httpx.post(f"{decode.url}/internal/decode", json=body, timeout=30,
                       headers={"x-statecore-token": TOKEN})
        lines = [json.loads(line) for line in r.text.splitlines() if line]
        assert lines and "error" in lines[-1], lines
        assert lines[-1]["error"]["code"] in code
        assert_no_leaks([decode])
        assert httpx.get(f"{decode.url}/health", timeout=5).status_code == 200  # it still serves
        assert decode.stats()["device_thread_alive"] and decode.stats()["bugs"] == 0
    finally:
        server.shutdown()


# One TLS context for the fresh client of every body: building one per client (loading the CA
# bundle) costs more than a tiny body's whole answer, and these nodes speak plain HTTP anyway.
_TLS = ssl.create_default_context()


def _answer(cluster: Cluster, path: str, body: Any) -> httpx.Response:
    with httpx.Client(timeout=60, verify=_TLS) as client:
        return client.post(f"{cluster.router.url}{path}", content=json.dumps(body).encode(),
                           headers={"content-type": "application/json"})


# Every body shape goes through the front end in-process, a thousand and more of them
# (tests/integration/test_request_bodies.py); here a sample of about 50 crosses the live
# cluster, router to nodes and back.
checked_bodies = [0]


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(call=valid_calls)
def test_valid_bodies_get_a_well_formed_answer(cluster: Cluster, call: tuple[str, dict[str, Any]]) -> None:
    path, body = call
    assert_well_formed(_answer(cluster, path, body), body)
    checked_bodies[0] += 1
    if checked_bodies[0] % 5 == 0:  # nothing piles up between batches of bodies
        assert_no_leaks(cluster.nodes[1:], timeout_s=15)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(call=valid_calls, violation=st.sampled_from(VIOLATIONS))
def test_each_violation_gets_its_own_error(cluster: Cluster, call: tuple[str, dict[str, Any]],
                                           violation: tuple[str, Any, int, str, str]) -> None:
    path, body = call
    field, value, status, code, param = violation
    bad = {**body, field: value}
    response = _answer(cluster, path, bad)
    assert response.status_code == status, (response.text, bad)
    error = assert_openai_error(response, bad)
    assert (error["code"], error["param"]) == (code, param), (error, bad)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_hostile_bodies_never_get_a_5xx(cluster: Cluster, body: Any, path: str) -> None:
    """Anything at all: a whole answer when it happens to be valid, else an OpenAI-shaped 4xx."""
    response = _answer(cluster, path, body)
    if response.status_code == 200:
        assert_well_formed(response, body)
    else:
        assert_openai_error(response, body)


def test_after_the_hostile_bodies_everything_is_clean(cluster: Cluster) -> None:
    assert_no_leaks(cluster.nodes[1:], timeout_s=15)
    assert post(cluster.router, "/v1/completions", GOOD).status_code == 200


def test_oversized_body_is_refused(cluster: Cluster) -> None:
    r = httpx.post(f"{cluster.router.url}/v1/completions", timeout=30,
                   content=b'{"prompt": "' + b"a" * (5 << 20) + b'"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_logs_of_the_marked_requests_show_their_terminal_state(cluster: Cluster, tmp_path: Path) -> None:
    log = cluster.router.log.read_text()
    assert "inject-fault-prefill-j" in log and "-> failed" in log
