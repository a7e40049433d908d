"""Prompts from request bodies, by the model's tokenizer: a completion's prompt (text or ids), a
chat's messages through the chat template (with its tools and extra variables), and what the
tokenizer decides of a request: which tools the model is offered, the constraint of a forced
tool call, XTC's protected tokens, `logit_bias` ids. Tokenizing runs on a worker thread, one at a
time. An adapter: it imports mlx-lm's tokenizer wrapper (as a value, never the weights), jinja2's
errors and `adapters.grammar`; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import trio
from jinja2 import TemplateError

from adapters.frontend.intake import Reject
from adapters.frontend.openai_bodies import (
    TEMPLATE_OWN_ARGUMENTS,
    ChatBody,
    Message,
    Sampling,
    TemplateValue,
    ToolChoice,
    check_grammar_ends,
)
from adapters.grammar import format_error, tool_call_text
from adapters.reasoning import ThinkMarkers
from effects.ports import Backend
from statecore.errors import Code, ErrorInfo, Fault, client_error
from statecore.policy import token_ids

__all__ = ["Prompts", "TemplateArgsRefused"]


class TemplateArgsRefused(ValueError):
    """The node's `--chat-template-args` cannot serve: the model has no chat template, or the
    template raises on them (found at start, before anything serves)."""


class Prompts:
    """The tokenizer's side of the front end: `tokenizer` is an mlx-lm `TokenizerWrapper`;
    `template_args` (`--chat-template-args`) go to the chat template of every chat, under what a
    request sets."""

    def __init__(self, tokenizer: Any, backend: Backend,
                 template_args: Mapping[str, TemplateValue] | None = None) -> None:
        self.tokenizer = tokenizer
        self._backend = backend
        self.template_args = dict(template_args or {})
        self._tokenizing = trio.CapacityLimiter(1)
        self.think_markers = ThinkMarkers.of(tokenizer)  # a reasoning model's (adapters.reasoning)
        template = getattr(tokenizer, "chat_template", None)
        sources = template.values() if isinstance(template, dict) else [template]
        self._template_reads_effort = any(isinstance(source, str) and "reasoning_effort" in source
                                          for source in sources)
        if self.template_args:
            self._check_template_args()

    def _check_template_args(self) -> None:
        """The start's template arguments on a one-message chat: what the template raises on is
        refused now, in one line, rather than in every chat's 400."""
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise TemplateArgsRefused("--chat-template-args: this model has no chat template")
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                               add_generation_prompt=True, tokenize=False,
                                               **self.template_args)
        except (TemplateError, TypeError, ValueError) as exc:
            raise TemplateArgsRefused(f"--chat-template-args: the chat template refused them: "
                                      f"{type(exc).__name__}: {exc}") from None

    async def run(self, work: Any, *args: Any) -> Any:
        """`work(*args)` on the tokenizing thread (one at a time)."""
        return await trio.to_thread.run_sync(work, *args, limiter=self._tokenizing)

    async def encode_prompt(self, prompt: str | list[int]) -> tuple[int, ...]:
        if not prompt:
            raise Reject(client_error("prompt must not be empty", param="prompt"))
        if isinstance(prompt, list):
            ids = token_ids(prompt, self._backend.model_info.vocab_size, "prompt: token id")
            if isinstance(ids, str):
                raise Reject(client_error(ids, param="prompt"))
            return tuple(ids)
        ids = await self.run(self.tokenizer.encode, prompt)
        return tuple(int(t) for t in ids)

    async def encode_chat(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] = (),
                           template_kwargs: Mapping[str, Any] | None = None) -> tuple[int, ...]:
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise Reject(
                ErrorInfo(
                    Fault.UNSUPPORTED,
                    Code.UNSUPPORTED_PARAMETER,
                    "this model has no chat template: use /v1/completions",
                )
            )
        apply = partial(
            self.tokenizer.apply_chat_template,
            [m.to_template() for m in messages],
            add_generation_prompt=True,
            tokenize=True,
            **({"tools": list(tools)} if tools else {}),
        )
        # the request's variables over the node's (`--chat-template-args`), as mlx_lm.server merges them
        try:
            variables = {**self.template_args, **(template_kwargs or {})}
            ids = await trio.to_thread.run_sync(partial(apply, **variables), limiter=self._tokenizing)
        except (TemplateError, TypeError, ValueError) as exc:
            if not template_kwargs:
                if isinstance(exc, TemplateError):
                    raise Reject(client_error(f"messages: the chat template refused them: {exc}",
                                              param="messages")) from None
                raise
            # whose fault: the messages alone (with the node's arguments), or the request's arguments
            try:
                await trio.to_thread.run_sync(partial(apply, **self.template_args), limiter=self._tokenizing)
            except TemplateError:
                raise Reject(client_error(f"messages: the chat template refused them: {exc}",
                                          param="messages")) from None
            raise Reject(client_error(f"chat_template_kwargs: the chat template refused them: "
                                      f"{type(exc).__name__}: {exc}",
                                      param="chat_template_kwargs")) from None
        return tuple(int(t) for t in ids)

    def template_kwargs(self, chat_template_kwargs: Mapping[str, Any] | None,
                        reasoning_effort: str | None = None) -> dict[str, Any]:
        """The request's extra variables of the chat template: `reasoning_effort` where the template
        reads it (else, for a model with think markers, "none" turns the thinking off and any other
        effort on), then the client's `chat_template_kwargs` over it; the names the front end gives
        the template itself are refused. `encode_chat` puts them over the node's `template_args`."""
        given = dict(chat_template_kwargs or {})
        taken = sorted(TEMPLATE_OWN_ARGUMENTS.intersection(given))
        if taken:
            raise Reject(client_error(f"chat_template_kwargs: {', '.join(taken)} is set by the server, "
                                      "not by a template argument", param="chat_template_kwargs"))
        return {**self._effort(reasoning_effort, "reasoning_effort"), **given}

    def _effort(self, effort: str | None, param: str) -> dict[str, Any]:
        if effort is None:
            return {}
        if self._template_reads_effort:
            return {"reasoning_effort": effort}
        if self.think_markers is not None:
            return {"enable_thinking": effort != "none"}
        raise Reject(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                               f"{param}: this model does not reason (its chat template reads no "
                               "reasoning_effort and it has no think markers that mlx-lm knows)", param))

    def one_call_only(self, body: Sampling, tools: Sequence[Mapping[str, Any]], constraint: str | None
                       ) -> tuple[str, ...]:
        """`parallel_tool_calls: false`: the generation stops where the first call's end marker
        would be (the open call is parsed as it stands), so a reply holds at most one call. A
        forced call needs nothing: its grammar allows one call."""
        if not tools or constraint is not None or not isinstance(body, ChatBody):
            return ()
        return (self.tokenizer.tool_call_end,) if body.parallel_tool_calls is False else ()

    def xtc(self, body: Sampling) -> dict[str, Any]:
        """XTC's settings; the tokens it never leaves out are mlx_lm.server's: a newline and EOS."""
        if not body.xtc_probability:
            return {}
        newline = self.tokenizer.encode("\n", add_special_tokens=False)
        special = sorted({*(int(t) for t in newline), *self._backend.model_info.eos_token_ids})
        return {"xtc_probability": body.xtc_probability,
                "xtc_threshold": 0.1 if body.xtc_threshold is None else body.xtc_threshold,
                "xtc_special_tokens": tuple(special)}

    def tools(self, body: ChatBody) -> tuple[dict[str, Any], ...]:
        """The tools the model is offered (none with `tool_choice: "none"`), checked against what
        it can do."""
        if not body.tools or body.tool_choice == "none":
            return ()
        if not getattr(self.tokenizer, "has_tool_calling", False):
            raise Reject(client_error("tools: this model's chat template has no tool calling "
                                      "(no tool-call markers that mlx-lm knows)", param="tools"))
        return tuple(tool.model_dump(exclude_none=True) for tool in body.tools)

    async def forced_call(self, body: Sampling, stops: Sequence[str]) -> str | None:
        """`tool_choice` "required" or a named function as the constraint of one call (None when
        nothing is forced): the model writes a call of one of the tools (of that one) between its
        tool-call markers, as JSON valid against the tool's parameters, and then ends."""
        if not isinstance(body, ChatBody) or not body.tools or body.tool_choice in (None, "auto", "none"):
            return None
        parser = getattr(self.tokenizer, "tool_parser", None)
        if not getattr(self.tokenizer, "has_tool_calling", False):
            return None  # `tools` refuses the tools themselves
        if not getattr(parser, "__module__", "").endswith(".json_tools"):
            raise Reject(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                f"tool_choice: forcing a call is served for models whose calls are JSON between markers "
                f"(mlx-lm's json_tools parser); this model's parser is {getattr(parser, '__module__', '?')}",
                "tool_choice"))
        tools = [(tool.function.name, tool.function.parameters) for tool in body.tools]
        if isinstance(body.tool_choice, ToolChoice):
            wanted = body.tool_choice.function.name
            tools = [tool for tool in tools if tool[0] == wanted]
            if not tools:
                raise Reject(client_error(f"tool_choice: no tool is named {wanted!r}",
                                          param="tool_choice.function.name"))
        check_grammar_ends(body, stops, "the tool call that tool_choice forces")
        try:
            text = tool_call_text(self.tokenizer.tool_call_start, self.tokenizer.tool_call_end, tools)
        except ValueError as exc:  # NaN or Infinity in a schema: not JSON
            raise Reject(client_error(f"tools: a parameters schema is not JSON: {exc}",
                                      param="tools")) from None
        error = await trio.to_thread.run_sync(format_error, text)
        if error is not None:
            raise Reject(client_error(f"tools: the parameters cannot be enforced for tool_choice: {error}",
                                      param="tools"))
        return text

    def adapter(self, name: str | None) -> str | None:
        """`adapters` (mlx_lm.server's field, one name): a LoRA adapter the node serves
        (`--adapters NAME=PATH`); another name is a 400 listing those it serves."""
        if name is None:
            return None
        served = self._backend.model_info.adapters
        if name not in served:
            serves = (f"serves {', '.join(repr(n) for n in served)}" if served else
                      "serves none (a node serves adapters named at start with --adapters NAME=PATH)")
            raise Reject(client_error(f"adapters: no adapter is named {name!r}; this server {serves}",
                                      param="adapters"))
        return name

    def logit_bias(self, given: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs in id order; an id must be a token of the model."""
        if not given:
            return ()
        vocab = self._backend.model_info.vocab_size
        biases: dict[int, float] = {}
        for key, bias in given.items():
            token = int(key) if key.strip().isdigit() else -1
            if isinstance(token_ids((token,), vocab, "logit_bias"), str):
                raise Reject(client_error(f"logit_bias: {key!r} is not a token id of this model "
                                          f"(0 to {vocab - 1})", param="logit_bias"))
            biases[token] = bias
        return tuple(sorted(biases.items()))
