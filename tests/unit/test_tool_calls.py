"""`ToolCallSplitter`: content and tool calls apart, however the text is cut into pieces."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters.tool_calls import ToolCall, ToolCallSplitter


def json_tools(text: str, tools: Any) -> Any:
    return json.loads(text.strip())  # the shape of mlx-lm's json_tools parser


REPLY = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\u00eds"}}\n</tool_call>'
         " Done.")


def split(pieces: list[str]) -> tuple[str, list[ToolCall]]:
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>", json_tools, [])
    content, calls = "", list[ToolCall]()
    for piece in pieces:
        text, found = splitter.feed(piece)
        content, calls = content + text, calls + found
    text, found = splitter.close()
    return content + text, calls + found


@pytest.mark.parametrize("size", [1, 2, 5, 11, len(REPLY)])
def test_markers_cut_anywhere_give_the_same_split(size: int) -> None:
    pieces = [REPLY[i: i + size] for i in range(0, len(REPLY), size)]
    assert split(pieces) == ("Let me look. Done.", [ToolCall("get_weather", '{"city": "Par\u00eds"}')])


def test_text_that_only_looks_like_a_marker_is_content() -> None:
    assert split(["a <tool", "_cal", "l is not here; <tool_c"]) == ("a <tool_call is not here; <tool_c", [])


def test_a_call_that_does_not_parse_stays_in_the_content() -> None:
    content, calls = split(["x<tool_call>{not json}</tool_call>y"])
    assert (content, calls) == ("x<tool_call>{not json}</tool_call>y", [])


def test_an_unterminated_call_at_the_end_is_parsed_and_several_calls_are_kept_in_order() -> None:
    first = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    content, calls = split([first, '<tool_call>{"name": "b", "arguments": "{\\"k\\": 1}"}'])
    assert content == "" and calls == [ToolCall("a", "{}"), ToolCall("b", '{"k": 1}')]


def test_a_parser_returning_a_list_gives_each_call() -> None:
    def two(text: str, tools: Any) -> Any:
        return [{"name": "a"}, {"name": "b", "arguments": {}}]

    splitter = ToolCallSplitter("[C]", "[/C]", two, [])
    assert splitter.feed("[C]x[/C]") == ("", [ToolCall("a", "{}"), ToolCall("b", "{}")])
    assert splitter.made_calls
