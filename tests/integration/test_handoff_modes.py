"""The router's view of which nodes take a streamed handoff: a node that takes none (tensor or
pipeline parallel) is pulled from, and so is one not heard from yet, until it answers: a router
that started while a node was still loading once streamed to a node that refuses streams (400)."""

from __future__ import annotations

import pytest
import trio

from adapters.serve import handoff_modes
from adapters.serve.handoff_modes import HandoffModes

STREAMS: dict[str, object] = {"kv_stream": True}
TAKES_NONE: dict[str, object] = {"kv_stream": False}


async def test_a_node_not_heard_from_is_pulled_from_until_its_info_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    answers: dict[str, dict[str, object] | None] = {"tp": None, "late": None}
    asked: list[str] = []
    answered = trio.Event()

    async def ask(node: str) -> dict[str, object] | None:
        asked.append(node)
        if answers["tp"] is not None and answers["late"] is not None:
            answered.set()
        return answers[node]

    modes = HandoffModes({"p": STREAMS, "tp": None, "late": None, "old": {}}, ask, stream=True)
    assert modes.streams("p", "old")  # a node from before the field existed takes streams
    assert not modes.streams("p", "tp") and not modes.streams("p", "late")  # not heard from: pull
    monkeypatch.setattr(handoff_modes, "ASK_AGAIN_S", 0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(modes.run)
        answers["tp"], answers["late"] = TAKES_NONE, STREAMS
        await answered.wait()
        with trio.fail_after(5):
            while modes.unknown:
                await trio.sleep(0.01)
    assert not modes.streams("p", "tp")  # it said it takes none
    assert modes.streams("p", "late") and modes.streams("late", "old")
    count = len(asked)
    await modes.run()  # every node answered: nothing left to ask
    assert len(asked) == count


async def test_pull_asked_for_pulls_from_every_node() -> None:
    async def never(node: str) -> None:
        raise AssertionError("nothing to ask when every handoff pulls")

    modes = HandoffModes({"p": STREAMS, "d": None}, never, stream=False)
    assert not modes.streams("p", "p")
    await modes.run()


async def test_the_router_starts_the_prefill_only_between_nodes_that_both_say_they_take_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    attach: dict[str, object] = {"kv_stream": True, "kv_attach": True}
    answers: dict[str, dict[str, object] | None] = {"late": None}

    async def ask(node: str) -> dict[str, object] | None:
        return answers[node]

    modes = HandoffModes({"p": attach, "d": attach, "old": STREAMS, "late": None}, ask, stream=True)
    assert modes.attaches("p", "d") and modes.streams("p", "d")
    assert modes.streams("p", "old") and not modes.attaches("p", "old")  # before kv_attach: it asks
    assert not modes.attaches("p", "late")
    via_decode = HandoffModes({"p": attach, "d": attach}, ask, stream=True, attach=False)
    assert via_decode.streams("p", "d") and not via_decode.attaches("p", "d")
    monkeypatch.setattr(handoff_modes, "ASK_AGAIN_S", 0.01)
    answers["late"] = attach
    with trio.fail_after(5):
        await modes.run()
    assert modes.attaches("late", "d")
