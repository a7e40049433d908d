"""The live view at `/ui`, in a real headless Chromium (Debian's `chromium`, driven by
Playwright through `executable_path`): on a router + prefill + decode cluster and a single
node, each node's page draws its machines, follows a request whose prefill is held for a moment (fault
injection's `slow`) through its phases, shows the router's peers and each node's rates, and
an open page does not hold a node's drain. Every wait is Playwright's polling `expect` or
`wait_for_function`, never a fixed sleep.

The screenshot in docs/img/live-view.png comes from this test: run it with
`STATECORE_WRITE_SCREENSHOT=1` to refresh it. Without a browser the test is skipped, except
under CI (`CI=true`), where that is a failure: CI installs it through scripts/test.sh.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

if os.environ.get("CI") != "true":  # under CI a missing package fails at the import below
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (scripts/setup.sh --dev does)")
from playwright.sync_api import Page, expect, sync_playwright

from effects.faults import DEFAULT_MARKER, ENABLE_ENV
from support.tiny_models import cached_checkpoint
from tests.e2e.harness import ROOT, Node, router, start_nodes

pytestmark = pytest.mark.e2e

SLOW_PREFILL_S = 2.0  # long enough for a page to see the request sitting in its prefill phases
WARM_UP_REQUESTS = 4  # traffic before the watched request, so the sparklines have a shape
POLL_MS = 20_000
SCREENSHOT = ROOT / "docs" / "img" / "live-view.png"


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing under CI; scripts/test.sh installs it")
    pytest.skip(f"{what} is not installed (bash scripts/test.sh installs it)")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None:
            return path
    _missing("the system Chromium (Debian package `chromium`)")
    raise AssertionError("unreachable")


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Node]]:
    monkeypatch.setenv(ENABLE_ENV, "1")
    model = cached_checkpoint("llama")
    prefill = Node("prefill", ["--model", str(model), "--inject-fault", f"prefill:slow={SLOW_PREFILL_S}"],
                   tmp_path / "prefill.log")
    decode = Node("decode", ["--model", str(model)], tmp_path / "decode.log")
    single = Node("single", ["--model", str(model)], tmp_path / "single.log")
    nodes = {"prefill": prefill, "decode": decode, "single": single}
    try:
        start_nodes([prefill, decode, single])
        nodes["router"] = router(model, tmp_path / "router.log", [prefill], [decode],
                                 "--force-disaggregation")
        start_nodes([nodes["router"]])
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


def _complete(node: Node, request_id: str, prompt: str) -> None:
    response = httpx.post(f"{node.url}/v1/completions", headers={"x-request-id": request_id},
                          json={"prompt": prompt, "max_tokens": 12}, timeout=60)
    assert response.status_code == 200, response.text


def _path(page: Page, machine: str, request_id: str) -> list[tuple[str, str]]:
    """The request's transitions as one page lists them, oldest first (the list is newest first)."""
    rows = page.locator(f'#transitions li[data-machine="{machine}"][data-subject="{request_id}"]')
    return [(row.get_attribute("data-from") or "", row.get_attribute("data-to") or "")
            for row in rows.all()][::-1]


def _assert_continuous(path: list[tuple[str, str]], start: list[str], end: str) -> None:
    phases = [path[0][0]] + [target for _, target in path]
    assert phases[: len(start)] == start, path
    assert phases[-1] == end, path
    assert all(a[1] == b[0] for a, b in itertools.pairwise(path)), path


def test_live_view_follows_a_request_through_every_node(cluster: dict[str, Node], tmp_path: Path) -> None:
    front, prefill, decode = cluster["router"], cluster["prefill"], cluster["decode"]
    for n in range(WARM_UP_REQUESTS):
        _complete(front, f"warm-up-{n}", "The harbour was quiet at dawn.")

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium())
        try:
            pages: dict[str, Page] = {}
            for role, node in (("router", front), ("prefill", prefill), ("decode", decode),
                               ("single", cluster["single"])):
                page = browser.new_page(viewport={"width": 1360, "height": 820})
                page.goto(f"{node.url}/ui")
                expect(page.locator("#status")).to_have_text("live", timeout=POLL_MS)
                expect(page.locator("#role")).to_have_text(role)
                pages[role] = page
            router_page = pages["router"]
            # a single node draws the request machine it runs (the decode node's), and no peers
            expect(pages["single"].locator('[data-machine="request_decode"][data-phase="prefilling_locally"]')
                   ).to_have_attribute("data-count", "0")
            expect(pages["single"].locator("#peers")).to_be_hidden()
            # the router's peers: both up, in the table and counted in the peer machine
            expect(router_page.locator("#peers td.phase-up")).to_have_count(2, timeout=POLL_MS)
            expect(router_page.locator('[data-machine="peer_health"][data-phase="up"]')).to_have_attribute(
                "data-count", "2")
            expect(router_page.locator('[data-machine="role_loop"][data-phase="serving"]')).to_have_class(
                re.compile(r"\bcurrent\b"))
            done = router_page.locator('[data-machine="request_router"][data-phase="done"]')
            expect(done).to_have_attribute("data-count", str(WARM_UP_REQUESTS), timeout=POLL_MS)

            request_id = f"ui-{DEFAULT_MARKER}-slow-prefill-{uuid.uuid4().hex[:8]}"
            sender = threading.Thread(target=_complete, args=(front, request_id, "Tell me about the sea."))
            sender.start()
            # while the prefill is held, each page shows the request sitting in its phase
            prefilling = router_page.locator('[data-machine="request_router"][data-phase="prefilling"]')
            expect(prefilling).to_have_attribute("data-count", "1", timeout=POLL_MS)
            expect(prefilling.locator(".count")).to_have_text("1 now")
            expect(pages["prefill"].locator('[data-machine="request_prefill"][data-phase="prefill"]')
                   ).to_have_attribute("data-count", "1", timeout=POLL_MS)
            router_page.screenshot(path=tmp_path / "live-view.png")
            if os.environ.get("STATECORE_WRITE_SCREENSHOT") == "1":
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(tmp_path / "live-view.png", SCREENSHOT)
            # ... and then done, and nothing left in the phase
            expect(done).to_have_attribute("data-count", str(WARM_UP_REQUESTS + 1), timeout=POLL_MS)
            expect(prefilling).to_have_attribute("data-count", "0")
            sender.join(timeout=60)

            # each node's list holds the request's whole path through its own machine
            _assert_continuous(_path(router_page, "request_router", request_id),
                               ["intake", "routed", "prefilling", "handing_off"], "done")
            _assert_continuous(_path(pages["prefill"], "request_prefill", request_id),
                               ["intake", "prefill", "handoff"], "done")
            _assert_continuous(_path(pages["decode"], "request_decode", request_id),
                               ["intake", "receiving_kv", "installing"], "done")

            # the rates: tokens flowed, the held prefill shows in the router's TTFT, KV moved
            def peak(page: Page, box: str, at_least: float) -> None:
                script = f"() => Number(document.querySelector('{box}').dataset.peak) >= {at_least}"
                page.wait_for_function(script, timeout=POLL_MS)

            peak(router_page, "#spark-tokens", 1)
            peak(router_page, "#spark-ttft", SLOW_PREFILL_S)
            peak(pages["decode"], "#spark-kv", 1)
            peak(pages["prefill"], "#spark-kv", 1)

            # an open page never holds a node's drain: the stream ends when the loop stops
            started = time.monotonic()
            assert decode.stop() == 0
            assert time.monotonic() - started < 4.5  # hypercorn's graceful wait is 5 s
            expect(pages["decode"].locator("#status")).to_have_text("node stopped", timeout=POLL_MS)
        finally:
            browser.close()
