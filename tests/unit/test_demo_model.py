"""The demo model shipped in ``src/adapters/demo_model`` loads with mlx_lm and writes English-like text.

``statecore run`` with no arguments serves this model, so these checks are what a user would notice:
it loads with no download, it is small, greedy text from a plain prompt is made of real words, and the
chat template renders the role markers the model was trained on. Words count as "real" when the
tokenizer learned them as whole-word tokens from the training text (Shakespeare's plays).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import adapters

DEMO_DIR = Path(adapters.__file__).resolve().parent / "demo_model"
MAX_BYTES = 20 * 1024 * 1024


@cache
def _load() -> tuple[Any, Any]:
    from mlx_lm.utils import load

    loaded: tuple[Any, ...] = tuple(load(str(DEMO_DIR)))
    return loaded[0], loaded[1]


@cache
def _vocabulary_words() -> frozenset[str]:
    """Whole words the byte-level BPE learned from the corpus ('Ġword' tokens, letters only)."""
    vocab: dict[str, int] = json.loads((DEMO_DIR / "tokenizer.json").read_text())["model"]["vocab"]
    words = {t[1:].lower() for t in vocab if t.startswith("\u0120") and t[1:].isalpha()}
    return frozenset(w for w in words if len(w) >= 2 or w in {"a", "i"})


def _generate(prompt: str, max_tokens: int = 40) -> str:
    from mlx_lm import generate

    model, tokenizer = _load()
    text: str = generate(model, tokenizer, prompt=prompt, max_tokens=max_tokens)
    return text


def test_demo_model_is_complete_and_small() -> None:
    names = {p.name for p in DEMO_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "SOURCE.md" in names
    total = sum(p.stat().st_size for p in DEMO_DIR.iterdir() if p.is_file())
    assert total <= MAX_BYTES


def test_word_list_is_meaningful() -> None:
    words = _vocabulary_words()
    assert len(words) > 1000
    assert {"the", "and", "king", "love", "lord"} <= words


def test_greedy_text_from_plain_prompt_is_english_like() -> None:
    text = _generate("Once upon a time")
    assert text.strip()
    letters_or_spaces = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters_or_spaces / len(text) >= 0.75, text
    found = {w.lower() for w in re.findall(r"[A-Za-z]+", text)} & _vocabulary_words()
    assert len(found) >= 5, text


def test_chat_template_renders_roles() -> None:
    _, tokenizer = _load()
    messages = [{"role": "user", "content": "What is your name?"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<s><|user|>\nWhat is your name?\n<|assistant|>\n"
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *messages],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert with_system.startswith("<s><|system|>\nBe brief.\n<|user|>\n")


def test_chat_prompt_gets_a_worded_answer() -> None:
    _, tokenizer = _load()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is your name?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    answer = _generate(prompt)
    assert "<|" not in answer
    found = {w.lower() for w in re.findall(r"[A-Za-z]+", answer)} & _vocabulary_words()
    assert len(found) >= 2, answer
