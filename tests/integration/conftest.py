"""Fixtures the integration tests share: the test tokenizer's directory (built once per session),
and a front end over a fake backend (modules that need other limits define their own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.frontend.frontend import Frontend
from support.tiny_models import build_tokenizer
from tests.integration.fake_backend import FakeBackend, fake_model_info


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
