"""Structured output's pieces without a model: the canonical text of a response_format, what
llguidance refuses, and one request's grammar state (its masks, EOS only where the JSON is whole,
rollback of a failed call, restart), on the tiny byte-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_tokenizer

from adapters.grammar import JSON_OBJECT, Grammars, format_error, response_format_text, tool_call_text
from adapters.mlx.grammar import TokenConstraint
from statecore.errors import StatecoreError
from support.tiny_models import TOKENIZER_VOCAB_SIZE, build_tokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}
EOS = frozenset({1})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = tmp_path_factory.mktemp("bpe")
    build_tokenizer(path, "bpe")
    return load_tokenizer(Path(path))  # type: ignore[no-untyped-call]


@pytest.fixture(scope="module")
def grammars(tokenizer: Any) -> Grammars:
    return Grammars(tokenizer, TOKENIZER_VOCAB_SIZE, EOS)


def allowed(constraint: TokenConstraint) -> set[int]:
    return {int(t) for t in np.flatnonzero(np.array(constraint.allowed()))}


def test_the_canonical_text_keeps_the_schema_as_written() -> None:
    text = response_format_text("json_schema", SCHEMA)
    assert text == json.dumps({"type": "json_schema", "schema": SCHEMA}, separators=(",", ":"))
    assert response_format_text("json_object") == JSON_OBJECT == '{"type":"json_object"}'
    assert response_format_text("json_schema") == '{"type":"json_schema","schema":{}}'
    with pytest.raises(ValueError):
        response_format_text("json_schema", {"maximum": float("nan")})


def test_what_llguidance_refuses_is_said_without_a_tokenizer() -> None:
    assert format_error(response_format_text("json_schema", SCHEMA)) is None
    assert format_error(JSON_OBJECT) is None
    assert "objekt" in str(format_error(response_format_text("json_schema", {"type": "objekt"})))
    assert format_error('{"type":"regex"}') is not None
    # a keyword it cannot enforce is refused even when the schema asks to be let off
    lenient = {"type": "object", "if": {"type": "object"}, "then": {}, "x-guidance": {"lenient": True}}
    assert "if" in str(format_error(response_format_text("json_schema", lenient)))
    one_of = {"oneOf": [{"type": "integer"}, {"type": "number"}], "x-guidance": {"coerce_one_of": True}}
    assert format_error(response_format_text("json_schema", one_of)) is not None
    assert format_error("not json") is not None


def test_a_document_walks_its_masks_and_only_then_may_end(grammars: Grammars, tokenizer: Any) -> None:
    constraint = TokenConstraint(grammars.matcher(response_format_text("json_schema", SCHEMA)),
                                 TOKENIZER_VOCAB_SIZE, EOS)
    document = tokenizer.encode('{"ok": true, "color": "blue"}', add_special_tokens=False)
    for token in document:
        mask = allowed(constraint)
        assert token in mask and not mask & EOS
        constraint.drew(mx.array([token]))
    assert allowed(constraint) == EOS  # whole: nothing but EOS
    free = TokenConstraint(grammars.matcher(JSON_OBJECT), TOKENIZER_VOCAB_SIZE, EOS)
    assert allowed(free) == set(tokenizer.encode("{", add_special_tokens=False))


def test_a_forced_tool_call_walks_the_markers_around_one_call_of_a_named_tool(
        grammars: Grammars, tokenizer: Any) -> None:
    unit = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    text = tool_call_text("<tool_call>", "</tool_call>", [("get_weather", SCHEMA), ("set_unit", unit)])
    assert format_error(text) is None

    def walk(reply: str) -> bool:
        """Whether the grammar lets `reply` through and then allows only EOS."""
        constraint = TokenConstraint(grammars.matcher(text), TOKENIZER_VOCAB_SIZE, EOS)
        for token in tokenizer.encode(reply, add_special_tokens=False):
            if token not in allowed(constraint):
                return False
            constraint.drew(mx.array([token]))
        return allowed(constraint) == EOS

    assert walk('<tool_call>\n{"name": "set_unit", "arguments": {"unit": "f"}}\n</tool_call>')
    weather = '{"name": "get_weather", "arguments": {"ok": true, "color": "red"}}'
    assert walk(f"<tool_call>\n{weather}\n</tool_call>")
    assert not walk('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not walk('<tool_call>\n{"name": "set_unit", "arguments": {"unit": "k"}}\n</tool_call>')
    assert not walk('Sure! <tool_call>')


def test_a_failed_call_is_rolled_back_and_a_restart_starts_over(grammars: Grammars, tokenizer: Any) -> None:
    text = response_format_text("json_schema", SCHEMA)
    head = tokenizer.encode('{"ok": ', add_special_tokens=False)
    constraint = TokenConstraint(grammars.matcher(text), TOKENIZER_VOCAB_SIZE, EOS, head[:1])
    for token in head[1:]:
        allowed(constraint)
        constraint.drew(mx.array([token]))
    before = constraint.mark()
    expected = allowed(constraint)  # consumes the last token of `head`
    constraint.drew(mx.array([min(expected)]))
    allowed(constraint)  # consumes that draw too
    constraint.reset(before)
    assert allowed(constraint) == expected
    constraint.restart()
    assert allowed(constraint) == set(tokenizer.encode("{", add_special_tokens=False))
    # a matcher of its own per request: the other requests' grammars are where they were
    assert allowed(TokenConstraint(grammars.matcher(text), TOKENIZER_VOCAB_SIZE, EOS, head)) == expected


def test_a_token_the_grammar_refuses_and_a_schema_it_refuses_are_errors(grammars: Grammars,
                                                                         tokenizer: Any) -> None:
    text = response_format_text("json_schema", SCHEMA)
    with pytest.raises(RuntimeError):
        TokenConstraint(grammars.matcher(text), TOKENIZER_VOCAB_SIZE, EOS,
                        tokenizer.encode("[", add_special_tokens=False))
    with pytest.raises(StatecoreError) as caught:
        grammars.matcher(response_format_text("json_schema", {"anyOf": []}))
    assert caught.value.info.param == "response_format" and caught.value.info.http_status == 400
