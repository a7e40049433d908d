"""Fixtures the integration tests share: the test tokenizer's directory (built once per session),
a front end over a fake backend (modules that need other limits define their own `backend` or
`frontend`; a module serving another front end overrides `app`), its app, and clients of that app
in process: raw HTTP (`client`) and the official SDKs (`claude`, `gpt`, over `sdk_http`: they talk
through `httpx2`). An in-process transport buffers a streamed body whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from starlette.applications import Starlette

from adapters.frontend.app import build_app
from adapters.frontend.frontend import Frontend
from support.tiny_models import build_tokenizer
from tests.integration.fake_backend import FakeBackend, fake_model_info

if TYPE_CHECKING:
    import anthropic
    import httpx2
    import openai


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer with a chat template (it lists tools and writes calls as
    <tool_call> JSON)."""
    path = tmp_path_factory.mktemp("bpe")
    build_tokenizer(path, "bpe")
    return path


@pytest.fixture(scope="session")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tokenizer with think markers, and a template that opens a think block (closed
    when `enable_thinking` is false), as a reasoning model's."""
    path = tmp_path_factory.mktemp("thinking")
    build_tokenizer(path, "bpe", thinking=True)
    return path


@pytest.fixture
def backend() -> FakeBackend:
    """A scripted backend whose model has a 2,048-token context."""
    return FakeBackend(fake_model_info(context_length=2048))


@pytest.fixture
def frontend(bpe_dir: Path, backend: FakeBackend) -> Frontend:
    return Frontend.load(bpe_dir, backend)


@pytest.fixture
def thinking(thinking_dir: Path, backend: FakeBackend) -> Frontend:
    """A front end over the reasoning tokenizer (`thinking_dir`)."""
    return Frontend.load(thinking_dir, backend)


@pytest.fixture
def app(frontend: Frontend) -> Starlette:
    return build_app(frontend)


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node") as client:
        yield client


# The SDKs are imported where a test asks for them: most integration tests never do.
@pytest.fixture
async def sdk_http(app: Starlette) -> AsyncIterator[httpx2.AsyncClient]:
    import httpx2

    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://node") as http:
        yield http


@pytest.fixture
def claude(sdk_http: httpx2.AsyncClient) -> anthropic.AsyncAnthropic:
    import anthropic

    return anthropic.AsyncAnthropic(api_key="none", base_url="http://node", http_client=sdk_http,
                                    max_retries=0)


@pytest.fixture
def gpt(sdk_http: httpx2.AsyncClient) -> openai.AsyncOpenAI:
    import openai

    return openai.AsyncOpenAI(api_key="none", base_url="http://node/v1", http_client=sdk_http, max_retries=0)
