"""Scripts of text for front-end tests over `FakeBackend`: a text's token ids in the front end's
tokenizer, the script of a backend that generates exactly that text, and the prompt the backend
was last given, as text."""

from __future__ import annotations

from adapters.frontend.frontend import Frontend
from tests.integration.fake_backend import FakeBackend, ScriptItem, completed, replied


def token_ids(frontend: Frontend, text: str) -> list[int]:
    return [int(t) for t in frontend.tokenizer.encode(text, add_special_tokens=False)]


def say(frontend: Frontend, text: str, end: str = "stop") -> list[ScriptItem]:
    """The script of a backend that generates exactly `text`, then ends with `end`."""
    return [*(replied(t) for t in token_ids(frontend, text)), completed(end)]


def prompt_text(frontend: Frontend, backend: FakeBackend) -> str:
    return str(frontend.tokenizer.decode(list(backend.last.request.prompt)))


__all__ = ["prompt_text", "say", "token_ids"]
