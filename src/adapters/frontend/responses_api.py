"""OpenAI's Responses API's answers: the response object (reasoning items, the output message with
its logprobs when `include` asked for them, function call items, status, usage, the request's
settings echoed) and the stream's named events, each with its sequence number, over a chat
started by `chat_run.start_chat` from the body `responses_bodies` maps. An adapter: nothing in
`statecore` or `effects` may import it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

from starlette.requests import Request
from starlette.responses import Response

from adapters.frontend.as_chat import Logprob, advance, answer
from adapters.frontend.chat_run import CalledTool, ChatEnd, ChatRun, ChatStep, start_chat
from adapters.frontend.frontend import Frontend
from adapters.frontend.responses_bodies import ResponsesBody, openai_error, parse_responses
from adapters.http.streaming import named_event
from statecore.errors import ErrorInfo
from statecore.policy import LENGTH

__all__ = ["ResponsesApi"]


def _event_logprobs(entries: Sequence[Logprob]) -> list[dict[str, object]]:
    """Logprobs as the stream's text events carry them (OpenAI's ResponseTextDeltaEvent and
    ResponseTextDoneEvent): `{token, logprob, top_logprobs: [{token, logprob}]}`, no `bytes`."""
    return [{"token": entry["token"], "logprob": entry["logprob"],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"]}
                              for top in entry["top_logprobs"]]} for entry in entries]


def _reasoning_text(text: str) -> dict[str, object]:
    return {"type": "reasoning_text", "text": text}


def _status(end: ChatEnd) -> str:
    return "incomplete" if end.reason == LENGTH else "completed"


class ResponsesApi:
    """`POST /v1/responses` over a `Frontend`."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def responses(self, request: Request) -> Response:
        started = await start_chat(self.frontend, request, parse_responses, openai_error)
        if isinstance(started, Response):
            return started
        run, body = started
        return await answer(request, run, stream=bool(body.stream),
                             body=lambda text, calls, end, logprobs, reasoning: self._response(
                                 run, body, text, end, calls, logprobs if body.logprobs else None,
                                 reasoning=[reasoning] if run.reasons and reasoning else []),
                             events=lambda first: self._response_events(run, body, first))

    @staticmethod
    def _text_part(text: str, logprobs: Sequence[Logprob] | None) -> dict[str, object]:
        """An output_text part; with the logprobs of its tokens when `include` asked for them."""
        part: dict[str, object] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = list(logprobs)
        return part

    @staticmethod
    def _reasoning_item(run: ChatRun, number: int, text: str | None, status: str) -> dict[str, object]:
        """A reasoning output item: the model's thinking as it wrote it, no summary (no content
        while it is only announced); the reply's first is `rs_<request id>`, a later one `..._<n>`."""
        content = [] if text is None else [_reasoning_text(text)]
        return {"id": f"rs_{run.request_id}" + (f"_{number}" if number else ""), "type": "reasoning",
                "summary": [], "content": content, "encrypted_content": None, "status": status}

    def _item(self, run: ChatRun, text: str | None, status: str,
              logprobs: Sequence[Logprob] | None = None) -> dict[str, object]:
        """The one output message (no content while it is only announced)."""
        content = [] if text is None else [self._text_part(text, logprobs)]
        return {"id": f"msg_{run.request_id}", "type": "message", "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _tool_choice(body: ResponsesBody) -> object:
        """The tool_choice in force, as the response object echoes it."""
        if body.tool_choice is None:
            return "auto" if body.tools else "none"
        return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()

    @staticmethod
    def _function_call(call: CalledTool, arguments: str | None = None, status: str = "completed"
                       ) -> dict[str, object]:
        """A function call output item (`arguments` "" while it is only announced)."""
        return {"id": f"fc_{call.id}", "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": call.arguments if arguments is None else arguments}

    @staticmethod
    def _top_logprobs(body: ResponsesBody) -> dict[str, object]:
        """`top_logprobs` as the response object echoes it: where the request gave it or asked for
        logprobs (a body without either stays as it was before logprobs were served)."""
        if body.top_logprobs is None and not body.logprobs:
            return {}
        return {"top_logprobs": body.top_logprobs or 0}

    def _response(self, run: ChatRun, body: ResponsesBody, text: str | None,
                  end: ChatEnd | ErrorInfo | None, calls: Sequence[CalledTool] = (),
                  logprobs: Sequence[Logprob] | None = None, *, streamed: bool = False,
                  reasoning: Sequence[str] = (), late_reasoning: str = "") -> dict[str, object]:
        """The response object: in progress (no text, no end), completed, incomplete, or failed.
        A reply of tool calls alone has no message item, unless a stream announced it already.
        `logprobs` (when `include` asked for them) are every generated token's, as the chat's.
        The model's thinking comes first as a reasoning item (`reasoning`), and thinking a stream
        met after the answer began (`late_reasoning`) as one more after the message."""
        thought_status = ("in_progress" if end is None else "incomplete" if isinstance(end, ErrorInfo)
                          else _status(end))
        output = [self._reasoning_item(run, 0, thought, thought_status) for thought in reasoning]
        later = [self._reasoning_item(run, 1, late_reasoning, thought_status)] if late_reasoning else []
        usage: dict[str, object] | None = None
        error: dict[str, str] | None = None
        incomplete: dict[str, str] | None = None
        if end is None:
            status = "in_progress"
        elif isinstance(end, ErrorInfo):
            status = "failed"
            error = {"code": end.code.value, "message": end.message}
            if text:
                output.append(self._item(run, text, "incomplete", logprobs))
        else:
            status = _status(end)
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            if text or not calls or streamed:
                output.append(self._item(run, text or "", status, logprobs))
            output += later
            output += [self._function_call(call) for call in calls]
            usage = {"input_tokens": run.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": run.cached_tokens or 0},
                     "output_tokens": end.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": end.reasoning_tokens},
                     "total_tokens": run.prompt_tokens + end.completion_tokens}
        return {
            "id": f"resp_{run.request_id}",
            "object": "response",
            "created_at": run.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.frontend.model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": body.reasoning.echoed() if body.reasoning else {"effort": None, "summary": None},
            "store": False,  # nothing is stored, whatever `store` asked
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": body.text_format()},
            "tool_choice": self._tool_choice(body),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            **self._top_logprobs(body),
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
        }

    async def _response_events(self, run: ChatRun, body: ResponsesBody, first: ChatStep
                               ) -> AsyncGenerator[bytes, None]:
        """response.created, response.in_progress, response.output_item.added,
        response.content_part.added, response.output_text.delta..., response.output_text.done,
        response.content_part.done, response.output_item.done, then each function call as an
        item of its own (added, function_call_arguments.delta and .done, output_item.done), then
        response.completed (or response.incomplete at max_output_tokens, as OpenAI sends it); each
        with its sequence_number. A failure on the way: response.failed.

        A reply that starts with thinking starts with a reasoning item (output_item.added,
        content_part.added of a `reasoning_text`, response.reasoning_text.delta...,
        reasoning_text.done, content_part.done, output_item.done) and its message item follows
        once the answer begins; thinking after that is one more reasoning item after the message.

        With `include` asking for logprobs, each delta carries those of the tokens its step
        consumed, and a step whose tokens show no text yet (held back for a stop string, a tool
        call's, the thinking's) sends them in a delta of "" (as the chat's stream sends them in a
        chunk of ""), so the deltas' logprobs are the done event's and the final output text's, in
        order; the events' entries are OpenAI's (no `bytes`), the output text's have them."""
        sequence = 0
        items = 0  # output items announced so far

        def event(kind: str, **fields: object) -> bytes:
            nonlocal sequence
            sequence += 1
            return named_event(kind, {"type": kind, **fields, "sequence_number": sequence - 1})

        def reasoning_item(number: int, deltas: Sequence[str]) -> list[bytes]:
            """A reasoning item's start, and `deltas` of its text."""
            nonlocal items
            index, items = items, items + 1
            item = self._reasoning_item(run, number, None, "in_progress")
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [event("response.output_item.added", output_index=index, item=item),
                    event("response.content_part.added", **where, part=_reasoning_text("")),
                    *(event("response.reasoning_text.delta", **where, delta=delta) for delta in deltas)]

        def reasoning_done(number: int, text: str, status: str) -> list[bytes]:
            item = self._reasoning_item(run, number, text, status)
            where = {"item_id": item["id"], "output_index": items - 1, "content_index": 0}
            return [event("response.reasoning_text.done", **where, text=text),
                    event("response.content_part.done", **where, part=_reasoning_text(text)),
                    event("response.output_item.done", output_index=items - 1, item=item)]

        step = first
        texts: list[str] = []
        thoughts: list[str] = []  # the first reasoning item's, while it is open
        late: list[str] = []  # thinking after the answer began
        calls: list[CalledTool] = []
        logprobs: list[Logprob] = []  # the steps' (none unless `include` asked for them)
        unsent: list[Logprob] = []  # of steps before the message began
        shown = logprobs if body.logprobs else None  # as the output text carries them
        where: dict[str, object] = {}  # the message's place, once it is announced
        try:
            yield event("response.created", response=self._response(run, body, None, None))
            yield event("response.in_progress", response=self._response(run, body, None, None))
            thinking = run.reasons and bool(first.reasoning)
            if thinking:
                for frame in reasoning_item(0, ()):
                    yield frame
            while True:
                frames: list[bytes] = []
                logprobs += step.logprobs
                if step.reasoning:
                    (thoughts if thinking else late).append(step.reasoning)
                    if thinking:
                        frames.append(event("response.reasoning_text.delta", item_id=f"rs_{run.request_id}",
                                            output_index=0, content_index=0, delta=step.reasoning))
                if not where and (step.text or step.end is not None or not thinking):
                    if thinking:
                        frames += reasoning_done(0, "".join(thoughts), "completed")
                        thinking = False
                    where = {"item_id": f"msg_{run.request_id}", "output_index": items, "content_index": 0}
                    frames += [event("response.output_item.added", output_index=items,
                                     item=self._item(run, None, "in_progress")),
                               event("response.content_part.added", **where,
                                     part=self._text_part("", [] if body.logprobs else None))]
                    items += 1
                if not where:
                    unsent += step.logprobs
                elif step.text or step.logprobs or unsent:
                    texts.append(step.text)
                    frames.append(event("response.output_text.delta", **where, delta=step.text,
                                        logprobs=_event_logprobs([*unsent, *step.logprobs])))
                    unsent = []
                calls += step.calls
                for frame in frames:
                    yield frame
                if step.end is not None:
                    break
                step = await advance(run)
            whole, end = "".join(texts), step.end
            reasoning = ["".join(thoughts)] if thoughts else []
            if isinstance(end, ErrorInfo):
                yield event("response.failed", response=self._response(
                    run, body, whole, end, (), shown, reasoning=reasoning, late_reasoning="".join(late)))
                return
            yield event("response.output_text.done", **where, text=whole,
                        logprobs=_event_logprobs(logprobs))
            yield event("response.content_part.done", **where, part=self._text_part(whole, shown))
            yield event("response.output_item.done", output_index=where["output_index"],
                        item=self._item(run, whole, _status(end), shown))
            if late:
                for frame in [*reasoning_item(1, late), *reasoning_done(1, "".join(late), _status(end))]:
                    yield frame
            for index, call in enumerate(calls, start=items):
                item_id = f"fc_{call.id}"
                yield event("response.output_item.added", output_index=index,
                            item=self._function_call(call, "", "in_progress"))
                yield event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                            delta=call.arguments)
                yield event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                            arguments=call.arguments)
                yield event("response.output_item.done", output_index=index, item=self._function_call(call))
            final = self._response(run, body, whole, end, calls, shown, streamed=True, reasoning=reasoning,
                                   late_reasoning="".join(late))
            yield event(f"response.{_status(end)}", response=final)
        finally:
            await run.cancel()
