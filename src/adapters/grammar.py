"""Structured output: a request's `response_format` as an llguidance grammar, and its matchers.

A constraint travels as `SamplingParams.response_format`: the canonical JSON text of what to
produce, `{"type":"json_object"}` or `{"type":"json_schema","schema":{...}}` (no spaces; the schema's
keys in the client's order, which is the order its properties are written in;
`response_format_text` makes it from what a client sent), or a forced tool call
(`tool_choice` "required" or a named function, `tool_call_text`):
`{"type":"tool_call","start":...,"end":...,"schema":{...}}`, one call written between the model's
tool-call markers as JSON `{"name": ..., "arguments": ...}` valid against `schema`. Every node
compiles the same grammar from the same text, and equal formats share one compiled grammar.
`format_error` tells the API (the router or a single node, before any engine sees the request) what
llguidance refuses, without a tokenizer. `Grammars` is the engine's: it wraps the model's
tokenizer for llguidance on first use and hands every constrained request a fresh `LLMatcher` (a
deep copy, ~1 us, of one compiled per format, ~1 ms, kept in a small LRU).

JSON is written the way `json.dumps` writes it, `", "` and `": "` and no other whitespace
(llguidance's `whitespace_flexible: false`): a bounded schema then has a bounded output, a model
cannot wander off into endless blank lines, and one document is one text on every node. A
`json_object` is any JSON object (`{"type": "object"}`). Why llguidance, and what it costs per token:
docs/engine.md. This module imports llguidance (and transformers through `llguidance.hf`); it must
never import mlx or trio: the router uses it too.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import llguidance

from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["JSON_OBJECT", "JSON_OPTIONS", "Grammars", "format_error", "grammar_of", "refused",
           "response_format_text", "tool_call_text"]

JSON_OBJECT = '{"type":"json_object"}'
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
    "coerce_one_of": False,
}
"""llguidance's JSON options, over whatever a schema's own `x-guidance` says: a keyword llguidance
cannot enforce is refused (never ignored), and `oneOf` stays exclusive, so what it lets through
validates."""

_COMPILED_KEPT = 64  # compiled formats an engine keeps (each holds its grammar's parser tables)


def response_format_text(kind: Literal["json_object", "json_schema"], schema: Mapping[str, Any] | None = None
                         ) -> str:
    """The canonical text of a constraint: a `json_object`, or a `json_schema` (no schema: any JSON
    value)."""
    if kind == "json_object":
        return JSON_OBJECT
    return json.dumps({"type": "json_schema", "schema": dict(schema or {})},
                      separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def tool_call_text(start: str, end: str, tools: Sequence[tuple[str, Mapping[str, Any] | None]]) -> str:
    """The canonical text of a forced tool call: one call of one of `tools` (each its name and
    its parameters' schema; none: any object), written between the markers `start` and `end`."""
    calls = [{"type": "object", "properties": {"name": {"const": name},
                                              "arguments": dict(parameters or {"type": "object"})},
              "required": ["name", "arguments"], "additionalProperties": False} for name, parameters in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return json.dumps({"type": "tool_call", "start": start, "end": end, "schema": schema},
                      separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _tool_call_grammar(doc: Mapping[str, Any]) -> str:
    # The markers on lines of their own around the JSON, as chat templates write a call.
    start, end, schema = doc.get("start"), doc.get("end"), doc.get("schema")
    if not (isinstance(start, str) and isinstance(end, str) and start and end and isinstance(schema, dict)):
        raise ValueError("a tool_call constraint needs its start and end markers and a schema")
    call = json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False, allow_nan=False)
    lark = (f"start: {json.dumps(start + chr(10), ensure_ascii=False)} call "
            f"{json.dumps(chr(10) + end, ensure_ascii=False)}\ncall: %json {call}")
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def _schema_of(text: str) -> dict[str, Any]:
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("a response_format is a JSON object")
    if doc.get("type") == "json_object":
        return {"type": "object"}
    schema = doc.get("schema") if doc.get("type") == "json_schema" else None
    if not isinstance(schema, dict):
        raise ValueError(f"not a response_format this engine knows: {text[:80]!r}")
    return schema


def grammar_of(text: str) -> str:
    """llguidance's grammar for a canonical constraint (ValueError when it is not one)."""
    doc = json.loads(text)
    if isinstance(doc, dict) and doc.get("type") == "tool_call":
        return _tool_call_grammar(doc)
    return str(llguidance.LLMatcher.grammar_from_json_schema(_schema_of(text), overrides=JSON_OPTIONS))


@functools.lru_cache(maxsize=256)
def format_error(text: str) -> str | None:
    """What llguidance says is wrong with a response_format's schema; None when it compiles."""
    try:
        grammar = grammar_of(text)
    except (ValueError, TypeError, RecursionError) as exc:
        return str(exc) or type(exc).__name__
    message = str(llguidance.LLMatcher.validate_grammar(grammar))
    return message or None


def refused(message: str) -> StatecoreError:
    """A 400 naming `response_format`: what llguidance (or JSON) says is wrong with the schema."""
    return StatecoreError(client_error(f"response_format: the schema cannot be enforced: {message}",
                                       param="response_format"))


class Grammars:
    """The matchers of one model's tokenizer: `matcher(text)` for each constrained request.

    Thread-safe (the engine compiles in worker threads, away from the device loop); wrapping
    the tokenizer for llguidance (0.06 s for the demo model's 4,096 tokens) happens on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: frozenset[int]) -> None:
        self._tokenizer = tokenizer  # mlx-lm's TokenizerWrapper, or a Hugging Face fast tokenizer
        self.vocab_size = vocab_size
        self.eos = eos
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def _wrapped(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=max(self.vocab_size, len(hf)), eos_token=sorted(self.eos))
            except Exception as exc:
                raise StatecoreError(ErrorInfo(
                    Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                    f"response_format: this model's tokenizer cannot drive a grammar ({type(exc).__name__}: "
                    f"{exc}); only Hugging Face fast tokenizers can", "response_format")) from exc
        return self._ll_tokenizer

    def matcher(self, text: str) -> Any:
        """A fresh `llguidance.LLMatcher` at the start of `text`'s grammar; a schema llguidance
        refuses is a client error naming `response_format`."""
        with self._lock:
            compiled = self._compiled.get(text)
            if compiled is not None:
                self._compiled.move_to_end(text)
                return compiled.deep_copy()
            tokenizer = self._wrapped()
        message = format_error(text)
        if message is not None:
            raise refused(message)
        compiled = llguidance.LLMatcher(tokenizer, grammar_of(text), log_level=0)
        if compiled.is_error():
            raise refused(compiled.get_error())
        with self._lock:
            self._compiled[text] = compiled
            self._compiled.move_to_end(text)
            while len(self._compiled) > _COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled.deep_copy()
