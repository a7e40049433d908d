"""Fixtures the integration tests share: the test tokenizer's directory, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.tiny_models import build_tokenizer


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer with a chat template (it lists tools and writes calls as
    <tool_call> JSON)."""
    path = tmp_path_factory.mktemp("bpe")
    build_tokenizer(path, "bpe")
    return path
