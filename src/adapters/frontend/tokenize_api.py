"""vLLM's `POST /tokenize` and `POST /detokenize`: the prompt ids a completion or a chat would be
fed (a `prompt` encoded as /v1/completions encodes it, `messages` through the chat template as
/v1/chat/completions applies it) with the context length, and text back from ids (special tokens
included). Unlike the generation bodies, these two refuse unknown fields. An adapter: nothing in
`statecore` or `effects` may import it.
"""

from __future__ import annotations

from functools import partial

from pydantic import Field
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from adapters.frontend.frontend import Frontend
from adapters.frontend.intake import Exact, Reject, error_response, parsed, unless_body_unread
from adapters.frontend.openai_bodies import Message, TemplateValue
from statecore.errors import client_error
from statecore.policy import token_ids

__all__ = ["TokenizeApi"]


class TokenizePrompt(Exact):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions encodes a text prompt


class TokenizeChat(Exact):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    chat_template_kwargs: dict[str, TemplateValue] | None = None  # as /v1/chat/completions takes them
    add_special_tokens: bool = False  # vLLM's default; the chat template places them


class Detokenize(Exact):
    model: str | None = None
    tokens: list[int]


class TokenizeApi:
    """The two endpoints over a `Frontend`."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def tokenize(self, request: Request) -> Response:
        """`POST /tokenize` (vLLM's): `prompt` encoded as /v1/completions encodes it, or `messages`
        through the chat template as /v1/chat/completions does; the ids and the context length."""
        try:
            data = await self.frontend.read_object(request)
            if "prompt" in data and "messages" in data:
                raise Reject(client_error("give either prompt or messages, not both", param="messages"))
            if "messages" in data:
                chat = parsed(TokenizeChat, data)
                self.frontend.check_model(chat.model)
                if chat.add_special_tokens:
                    raise Reject(client_error(
                        "add_special_tokens: with messages only false is allowed (the chat template "
                        "places the special tokens, as in /v1/chat/completions)", param="add_special_tokens"))
                tokens = await self.frontend.prompts.encode_chat(
                    chat.messages, (), self.frontend.prompts.template_kwargs(chat.chat_template_kwargs))
            else:
                text = parsed(TokenizePrompt, data)
                self.frontend.check_model(text.model)
                encode = partial(self.frontend.tokenizer.encode, text.prompt,
                                 add_special_tokens=text.add_special_tokens)
                ids = await self.frontend.prompts.run(encode)
                tokens = tuple(int(t) for t in ids)
        except Reject as exc:
            return unless_body_unread(request, error_response(exc.info))
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"tokens": list(tokens), "count": len(tokens),
                             "max_model_len": self.frontend.backend.model_info.context_length})

    async def detokenize(self, request: Request) -> Response:
        """`POST /detokenize` (vLLM's): the text of token ids, special tokens included."""
        try:
            body = parsed(Detokenize, await self.frontend.read_object(request))
            self.frontend.check_model(body.model)
            ids = token_ids(body.tokens, self.frontend.backend.model_info.vocab_size, "tokens: token id")
            if isinstance(ids, str):
                raise Reject(client_error(ids, param="tokens"))
            decode = partial(self.frontend.tokenizer.decode, body.tokens)
            text = await self.frontend.prompts.run(decode)
        except Reject as exc:
            return unless_body_unread(request, error_response(exc.info))
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse({"prompt": str(text)})
