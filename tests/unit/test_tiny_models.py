"""Tiny offline checkpoints: every family loads in mlx-lm, builds the cache we expect, and generates
context-sensitive text; builds are byte-deterministic; both tokenizers round-trip text."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import load
from transformers import AutoTokenizer

from support import tiny_models as tm

EXPECTED_CACHES: dict[str, list[str]] = {
    "llama": ["KVCache", "KVCache"],
    "qwen3": ["KVCache", "KVCache"],
    "gemma3_text": ["RotatingKVCache", "KVCache"],
    "qwen3_next": ["ArraysCache", "KVCache"],
    "falcon_h1": ["CacheList(ArraysCache, KVCache)"] * 2,
    "mamba2": ["ArraysCache", "ArraysCache"],
    "llama4": ["ChunkedKVCache"] * 3 + ["KVCache"],
}

# The first two prompts end in the same token: a model that only looked at the last token
# would continue them identically.
PROMPTS = (
    "The cat sat on the mat.",
    "A dog ran in the park.",
    "Numbers: 1, 2, 3, 10 and 42",
    "def add(a, b):",
)
NON_ASCII = "Héllo wörld, café 日本語 🙂 naïve — done."


def describe(cache: Any) -> str:
    name = type(cache).__name__
    if isinstance(cache, mlx_cache.CacheList):
        return f"{name}({', '.join(describe(c) for c in cache.caches)})"
    return name


Loaded = tuple[Any, TokenizerWrapper]


def load_model(path: Path, *, trust_remote_code: bool = False) -> Loaded:
    """mlx_lm.utils.load, without its optional third result."""
    result = load(str(path), trust_remote_code=trust_remote_code)
    return result[0], result[1]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Loaded]]:
    """family -> (model, tokenizer) of the float32 bpe checkpoint, built and loaded once."""
    root = tmp_path_factory.mktemp("families")
    models: dict[str, Loaded] = {}

    def get(family: str) -> Loaded:
        if family not in models:
            path = tm.build_tiny_checkpoint(root / family, family)
            model, tokenizer = load_model(path)
            models[family] = (model, tokenizer)
        return models[family]

    yield get


def long_prompt(tokenizer: TokenizerWrapper, n: int) -> list[int]:
    ids: list[int] = tokenizer.encode(tm.CORPUS * 3, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


# ---------------------------------------------------------------------------------------------
# Families


def test_family_table_is_complete() -> None:
    assert set(EXPECTED_CACHES) == set(tm.FAMILIES)


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_family_loads_with_the_expected_caches(family: str, loaded: Callable[[str], Loaded]) -> None:
    model, tokenizer = loaded(family)
    assert isinstance(tokenizer, TokenizerWrapper)
    caches = mlx_cache.make_prompt_cache(model)
    assert [describe(c) for c in caches] == EXPECTED_CACHES[family]
    config = tm.family_config(family)
    vocab = config.get("text_config", config)["vocab_size"]
    assert vocab >= len(tokenizer) == tm.TOKENIZER_VOCAB_SIZE


@pytest.mark.parametrize("family", tm.FAMILIES)
def test_greedy_output_is_not_degenerate_and_depends_on_context(
    family: str, loaded: Callable[[str], Loaded]
) -> None:
    model, tokenizer = loaded(family)
    outputs = [tm.greedy_tokens(model, tokenizer.encode(p), 32) for p in PROMPTS]
    for prompt, tokens in zip(PROMPTS, outputs, strict=True):
        assert len(tokens) == 32
        assert not tm.is_degenerate(tokens), (prompt, tokens)
    assert tokenizer.encode(PROMPTS[0])[-1] == tokenizer.encode(PROMPTS[1])[-1]
    assert len({tuple(t) for t in outputs}) == len(PROMPTS)


@pytest.mark.parametrize("family", tm.FAMILIES)
@pytest.mark.parametrize("dtype", tm.DTYPES)
def test_every_dtype_loads_and_runs(family: str, dtype: str, tmp_path: Path) -> None:
    model, tokenizer = load_model(tm.build_tiny_checkpoint(tmp_path, family, dtype=dtype))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    params: dict[str, mx.array] = {}
    tree_flatten(model.parameters(), destination=params)
    assert {p.dtype for p in params.values()} == {getattr(mx, dtype)}
    prompt = long_prompt(tokenizer, 40)
    steps = list(generate_step(mx.array(prompt), model, max_tokens=8))
    assert len(steps) == 8
    for _, logprobs in steps:
        assert bool(mx.all(mx.isfinite(logprobs)))


def prefill_then_step(model: Any, prompt: list[int]) -> list[Any]:
    """Run the whole prompt in one call, then one decode step, as a serving node would."""
    caches = mlx_cache.make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=caches)
    model(mx.argmax(logits[:, -1:], axis=-1), cache=caches)
    mx.eval([c.state for c in caches])
    return caches


@pytest.mark.parametrize("n", [33, 257])
def test_gemma3_prompts_wrap_the_sliding_window(n: int, loaded: Callable[[str], Loaded]) -> None:
    model, tokenizer = loaded("gemma3_text")
    sliding, full = prefill_then_step(model, long_prompt(tokenizer, n))
    assert sliding.max_size == tm.GEMMA3_SLIDING_WINDOW < n
    assert sliding.offset == full.offset == n + 1
    assert sliding.keys.shape[2] == tm.GEMMA3_SLIDING_WINDOW


def test_llama4_long_prompt_crosses_chunks(loaded: Callable[[str], Loaded]) -> None:
    model, tokenizer = loaded("llama4")
    caches = prefill_then_step(model, long_prompt(tokenizer, 257))
    chunked = caches[0]
    assert chunked.chunk_size == tm.LLAMA4_ATTENTION_CHUNK
    assert chunked.offset == 258
    assert chunked.start_position > 0


def test_larger_shapes_build() -> None:
    config = tm.family_config("qwen3_next", hidden_size=128, num_layers=4)
    assert config["num_hidden_layers"] == 4
    assert tm.family_config("llama4", num_layers=2)["text_config"]["num_hidden_layers"] == 4
    with pytest.raises(ValueError, match="multiple of 32"):
        tm.family_config("llama", hidden_size=40)
    with pytest.raises(ValueError, match="unknown family"):
        tm.family_config("gpt2")


def test_the_head_dim_is_an_option(tmp_path: Path) -> None:
    """A head dim MLX's CUDA attention kernels take (64) for a GPU benchmark's model; 16 stays the
    default."""
    assert tm.family_config("llama")["head_dim"] == 16
    with pytest.raises(ValueError, match="multiple of 128"):
        tm.family_config("llama", hidden_size=192, head_dim=64)
    path = tm.build_tiny_checkpoint(tmp_path, "llama", hidden_size=256, head_dim=64)
    model, _ = load_model(path)
    cache = prefill_then_step(model, list(range(3, 40)))
    assert cache[0].keys.shape[1:] == (2, 256, 64)  # 4 query heads, 2 key/value heads of width 64


def test_larger_model_runs(tmp_path: Path) -> None:
    path = tm.build_tiny_checkpoint(tmp_path, "falcon_h1", hidden_size=128, num_layers=4)
    model, tokenizer = load_model(path)
    assert len(mlx_cache.make_prompt_cache(model)) == 4
    assert not tm.is_degenerate(tm.greedy_tokens(model, tokenizer.encode(PROMPTS[0]), 32))


# ---------------------------------------------------------------------------------------------
# Determinism


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize(
    ("family", "dtype", "tokenizer"),
    [("llama", "bfloat16", "byte_fallback"), ("qwen3_next", "float32", "bpe")],
)
def test_build_is_byte_deterministic(
    family: str, dtype: str, tokenizer: tm.TokenizerKind, tmp_path: Path
) -> None:
    first = tm.build_tiny_checkpoint(tmp_path / "a", family, dtype=dtype, tokenizer=tokenizer)
    second = tm.build_tiny_checkpoint(tmp_path / "b", family, dtype=dtype, tokenizer=tokenizer)
    assert set(tree_bytes(first)) == {
        "config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert tree_bytes(first) == tree_bytes(second)
    other = tm.build_tiny_checkpoint(tmp_path / "c", family, dtype=dtype, tokenizer=tokenizer, seed=1)
    assert tree_bytes(other)["model.safetensors"] != tree_bytes(first)["model.safetensors"]


# ---------------------------------------------------------------------------------------------
# Tokenizers


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    for kind in tm.TOKENIZER_KINDS:
        tm.build_tokenizer(root / kind, kind)
    return {kind: root / kind for kind in tm.TOKENIZER_KINDS}


@pytest.mark.parametrize(
    ("kind", "detokenizer"),
    [("bpe", BPEStreamingDetokenizer), ("byte_fallback", SPMStreamingDetokenizer)],
)
def test_tokenizer_loads_with_the_right_streaming_detokenizer(
    kind: str, detokenizer: type, tokenizers: dict[str, Path]
) -> None:
    wrapper = load_tokenizer(tokenizers[kind])
    assert isinstance(wrapper, TokenizerWrapper)
    assert type(wrapper.detokenizer) is detokenizer
    assert len(wrapper) == tm.TOKENIZER_VOCAB_SIZE
    assert wrapper.bos_token is not None and wrapper.eos_token is not None
    assert wrapper.eos_token_ids == {wrapper.eos_token_id}
    ids = wrapper.encode("hello")
    assert ids[0] == wrapper.bos_token_id


@pytest.mark.parametrize("kind", tm.TOKENIZER_KINDS)
@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog.", NON_ASCII])
def test_tokenizer_round_trips_text(kind: str, text: str, tokenizers: dict[str, Path]) -> None:
    wrapper = load_tokenizer(tokenizers[kind])
    ids = wrapper.encode(text, add_special_tokens=False)
    assert wrapper.decode(ids) == text
    detokenizer = wrapper.detokenizer
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        assert text.startswith(detokenizer.text)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    assert detokenizer.text == "".join(segments) == text


def test_byte_fallback_spells_non_ascii_as_byte_pieces(tokenizers: dict[str, Path]) -> None:
    wrapper = load_tokenizer(tokenizers["byte_fallback"])
    vocab = wrapper.get_vocab()
    assert all(f"<0x{b:02X}>" in vocab for b in range(256))
    pieces = wrapper.convert_ids_to_tokens(wrapper.encode("é", add_special_tokens=False))
    assert pieces[-2:] == ["<0xC3>", "<0xA9>"]
    pieces = wrapper.convert_ids_to_tokens(wrapper.encode("日本", add_special_tokens=False))
    assert pieces[-6:] == ["<0xE6>", "<0x97>", "<0xA5>", "<0xE6>", "<0x9C>", "<0xAC>"]
    tokenizer_json = json.loads((tokenizers["byte_fallback"] / "tokenizer.json").read_text())
    assert tokenizer_json["model"]["byte_fallback"] is True
    assert tokenizer_json["pre_tokenizer"]["type"] == "Metaspace"


def test_bpe_is_byte_level(tokenizers: dict[str, Path]) -> None:
    tokenizer_json = json.loads((tokenizers["bpe"] / "tokenizer.json").read_text())
    assert tokenizer_json["pre_tokenizer"]["type"] == "ByteLevel"
    assert tokenizer_json["decoder"]["type"] == "ByteLevel"
    wrapper = load_tokenizer(tokenizers["bpe"])
    assert not any(t.startswith("<0x") for t in wrapper.get_vocab())


@pytest.mark.parametrize("kind", tm.TOKENIZER_KINDS)
def test_chat_template_renders_through_transformers(kind: str, tokenizers: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizers[kind])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    assert text.startswith(tokenizer.bos_token)
    assert "Hi there" in text and text.endswith("<assistant>\n")
    assert text.count(tokenizer.eos_token) == 2
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


# ---------------------------------------------------------------------------------------------
# A model with its own cache class


def test_custom_cache_checkpoint(tmp_path: Path, loaded: Callable[[str], Loaded]) -> None:
    path = tm.build_custom_cache_checkpoint(tmp_path / "opaque")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(path)
    model, tokenizer = load_model(path, trust_remote_code=True)

    caches = mlx_cache.make_prompt_cache(model)
    mlx_classes = tuple(
        v for v in vars(mlx_cache).values() if isinstance(v, type) and v.__module__ == mlx_cache.__name__
    )
    for c in caches:
        assert not isinstance(c, mlx_classes)
        assert not type(c).__module__.startswith("mlx_lm")
    text = mlx_lm.generate(model, tokenizer, PROMPTS[0], max_tokens=8)
    assert isinstance(text, str) and text

    # Same weights as the plain llama of the same seed: same greedy tokens.
    ids = tokenizer.encode(PROMPTS[0])
    plain_model, _ = loaded("llama")
    caches = mlx_cache.make_prompt_cache(model)
    tokens = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=16, prompt_cache=caches)]
    assert tokens == tm.greedy_tokens(plain_model, ids, 16)
    state = caches[0].state
    assert any(not isinstance(x, mx.array) and x is not None for x in state)


# ---------------------------------------------------------------------------------------------
# The build cache


def test_cached_checkpoint_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = tm.cached_checkpoint("mamba2", root=tmp_path, seed=2)
    assert first.parent == tmp_path
    assert (first / "model.safetensors").is_file()

    def refuse(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("rebuilt a cached checkpoint")

    monkeypatch.setattr(tm, "build_tiny_checkpoint", refuse)
    assert tm.cached_checkpoint("mamba2", root=tmp_path, seed=2) == first
    monkeypatch.setenv("STATECORE_TINY_CACHE", str(tmp_path))
    assert tm.cached_checkpoint("mamba2", seed=2) == first
    with pytest.raises(TypeError):
        tm.cached_checkpoint("mamba2", root=tmp_path, colour="red")
    # an edit to the builders' source (its digest) is a new key: the old build is not reused
    monkeypatch.setattr(tm, "_BUILDER_DIGEST", "an-edited-source")
    with pytest.raises(AssertionError, match="rebuilt"):
        tm.cached_checkpoint("mamba2", root=tmp_path, seed=2)


def test_cached_checkpoint_survives_a_race(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    racers = 3
    everyone_built = threading.Barrier(racers, timeout=30)
    build = tm.build_tiny_checkpoint

    def build_then_wait(*args: Any, **kwargs: Any) -> Path:
        out = build(*args, **kwargs)
        everyone_built.wait()  # every racer has a full copy before anyone renames
        return out

    monkeypatch.setattr(tm, "build_tiny_checkpoint", build_then_wait)
    with ThreadPoolExecutor(racers) as pool:
        paths = list(pool.map(lambda _: tm.cached_checkpoint("llama", root=tmp_path), range(racers)))
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]
    model, _ = load_model(paths[0])
    assert len(model.layers) == 2


# ---------------------------------------------------------------------------------------------
# Small pieces


@pytest.mark.parametrize(
    ("tokens", "degenerate"),
    [
        ([], True),
        ([7] * 32, True),
        ([1, 2, 3] * 11, True),
        ([1, 2, 3, 4] * 8, False),
        ([5] * 17 + list(range(15)), True),
        (list(range(32)), False),
    ],
)
def test_is_degenerate(tokens: list[int], degenerate: bool) -> None:
    assert tm.is_degenerate(tokens) is degenerate


def test_cli_builds_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    args = ["--family", "mamba2", "--dtype", "bfloat16", "--tokenizer", "byte_fallback"]
    done = subprocess.run(
        [sys.executable, "-m", "support.tiny_models", str(out), *args],
        cwd=Path(__file__).resolve().parents[2],  # support/ sits at the repository's root
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mamba2" and config["torch_dtype"] == "bfloat16"
    same = tm.build_tiny_checkpoint(tmp_path / "api", "mamba2", dtype="bfloat16", tokenizer="byte_fallback")
    assert tree_bytes(out) == tree_bytes(same)
    assert math.isclose(config["time_step_limit"][1], 1000.0)
