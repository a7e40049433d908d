"""The reasoning splitter (`adapters.reasoning`): thinking and answer apart, markers dropped and
nothing else, whatever pieces the text comes in; whether a prompt leaves a think block open."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.reasoning import ReasoningSplitter, ThinkMarkers, opens_thinking

THINK = ThinkMarkers("<think>", "</think>", (510,), (511,))
CHANNEL = ThinkMarkers("<|channel>thought", "<channel|>", (7, 8), (9,))  # a marker of two tokens


def split(markers: ThinkMarkers, pieces: list[str], *, thinking: bool) -> tuple[list[str], list[str]]:
    """Everything the splitter sends, piece by piece (close included)."""
    splitter = ReasoningSplitter(markers, thinking=thinking)
    sent = [splitter.feed(piece) for piece in pieces] + [splitter.close()]
    return [r for r, _ in sent], [c for _, c in sent]


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), [
    ("<think>\nplan\n</think>\n\nHello", False, "\nplan\n", "\n\nHello"),  # Qwen3: the model opens it
    ("plan</think>Hello", True, "plan", "Hello"),  # DeepSeek-R1: the prompt opened it
    ("Hello", False, "", "Hello"),  # no thinking at all
    ("still thinking", True, "still thinking", ""),  # cut before the end marker
    ("<think></think>Hi", False, "", "Hi"),
    ("a</think>b", False, "", "a</think>b"),  # an end marker outside the thinking is text
    ("x<think>y</think>z<think>w", False, "yw", "xz"),  # a model may think again later
])
def test_whole_text(text: str, thinking: bool, reasoning: str, content: str) -> None:
    reasonings, contents = split(THINK, [text], thinking=thinking)
    assert ("".join(reasonings), "".join(contents)) == (reasoning, content)


def test_a_marker_split_across_pieces_is_held_back_until_known() -> None:
    splitter = ReasoningSplitter(THINK, thinking=False)
    assert splitter.feed("Hi <th") == ("", "Hi ")
    assert splitter.feed("ink>plan </thi") == ("plan ", "")
    assert splitter.thinking
    assert splitter.feed("s is not the end") == ("</this is not the end", "")
    assert splitter.feed("</think>ok <") == ("", "ok ")
    assert not splitter.thinking
    assert splitter.close() == ("", "<")  # held back, then the reply ended: it was content


def test_markers_of_several_tokens() -> None:
    pieces = ["<|chan", "nel>thought", "why<chan", "nel|>", "so"]
    reasonings, contents = split(CHANNEL, pieces, thinking=False)
    assert ("".join(reasonings), "".join(contents)) == ("why", "so")


@given(st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think>", "a", "\n", "é", "<th", "k>"]),
                max_size=12),
       st.data(), st.booleans())
def test_reasoning_and_content_are_the_text_less_its_switching_markers(
        words: list[str], data: st.DataObject, thinking: bool) -> None:
    text = "".join(words)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reasonings, contents = split(THINK, pieces, thinking=thinking)
    whole_reasoning, whole_content = split(THINK, [text], thinking=thinking)
    # piecewise is the same as whole
    assert "".join(reasonings) == "".join(whole_reasoning) and "".join(contents) == "".join(whole_content)
    # an oracle: walk the text, switching at each marker that switches
    expected = {True: "", False: ""}
    state, rest = thinking, text
    while rest:
        marker = THINK.end if state else THINK.start
        at = rest.find(marker)
        if at < 0:
            expected[state] += rest
            break
        expected[state] += rest[:at]
        rest, state = rest[at + len(marker):], not state
    assert ("".join(reasonings), "".join(contents)) == (expected[True], expected[False])


@pytest.mark.parametrize(("prompt", "opened"), [
    ((1, 2, 510, 3), True),  # the generation prompt opens a think block
    ((1, 510, 4, 511, 5), False),  # an earlier turn's thinking, closed
    ((1, 510, 511, 6, 510), True),
    ((1, 2, 3), False),
])
def test_opens_thinking(prompt: tuple[int, ...], opened: bool) -> None:
    assert opens_thinking(prompt, THINK) is opened


def test_opens_thinking_with_markers_of_several_tokens() -> None:
    assert opens_thinking((1, 7, 8, 4), CHANNEL)
    assert not opens_thinking((1, 7, 8, 4, 9), CHANNEL)
    assert not opens_thinking((1, 8, 7, 4), CHANNEL)


def test_markers_come_from_the_tokenizer_wrapper_and_a_model_without_them_has_none() -> None:
    class Wrapper:
        think_start, think_end = "<think>", "</think>"
        think_start_tokens, think_end_tokens = (510,), (511,)

    class Plain:
        think_start = think_end = think_start_tokens = think_end_tokens = None

    assert ThinkMarkers.of(Wrapper()) == THINK
    assert ThinkMarkers.of(Plain()) is None
    assert ThinkMarkers.of(object()) is None
