"""Loading a model directory with mlx-lm, and what a node reports about it (ModelInfo).

`load_model` runs on the device thread: it reads config.json, refuses custom model code without
trust_remote_code, loads weights and tokenizer through mlx-lm, and collects the EOS ids.
With a `pipeline_group` each rank keeps only its share of the layers (mlx-lm's
`model.model.pipeline`, in the families of `PIPELINE_FAMILIES`).
With an `adapter_path` (`--adapter-path`, an mlx-lm LoRA/DoRA adapter directory) the adapter's
layers are applied as mlx-lm applies them (not fused: the same numbers as mlx-lm with it).
`model_fingerprint` is what two nodes must share to exchange KV: the engine's format version, the
config's bytes, the parameter dtypes, kv_bits, the prefill chunk size, the BLAS in use, the
adapter's bytes (when one is applied: a prompt's KV depends on it) and the per-request adapters'
names and bytes (`--adapters`).
This module imports mlx and mlx_lm; it must never import trio.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load as mlx_lm_load

from adapters.blas import blas_in_use
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error

__all__ = ["DEFAULT_CONTEXT_LENGTH", "FORMAT_VERSION", "PIPELINE_FAMILIES", "LoadedModel", "load_model",
           "model_fingerprint", "pipeline_refusal"]

FORMAT_VERSION = 1
"""Bumped whenever the computation order or the sampling rule changes: part of the fingerprint."""

DEFAULT_CONTEXT_LENGTH = 4096
"""Used when config.json names no context length (e.g. pure state-space models)."""

PIPELINE_FAMILIES = (
    "bailing_hybrid", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v41", "glm4_moe",
    "glm4_moe_lite", "kimi_k25", "minimax_m3_vl", "ministral3", "mistral4", "muse_spark", "qwen2",
    "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next",
)
"""The config.json model types whose mlx-lm (0.32) model can pipeline (`model.model.pipeline`)."""

_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: Any
    eos: frozenset[int]
    config_bytes: bytes
    dtypes: tuple[str, ...]
    context_length: int
    tokenizer: Any = None  # mlx-lm's TokenizerWrapper (structured output compiles grammars over it)
    adapter_sha256: str | None = None  # the applied adapter's config and weights, hashed


def pipeline_refusal(model_type: object, ranks: int) -> str | None:
    """Why a model of `model_type` cannot run as a pipeline of `ranks` ranks (None: it can)."""
    if model_type in PIPELINE_FAMILIES:
        return None
    return (f"mlx-lm has no pipeline parallelism for model type {model_type!r}: --pipeline-parallel "
            f"{ranks} needs one of {', '.join(PIPELINE_FAMILIES)} (--tensor-parallel shards llama, "
            "qwen3 and others by heads instead)")


def load_model(model_dir: Path, *, trust_remote_code: bool, shard_group: Any = None,
               pipeline_group: Any = None, adapter_path: Path | None = None) -> LoadedModel:
    """`shard_group` (an `mx.distributed.Group` of more than one rank): load lazily and keep this
    rank's tensor-parallel shard only (mlx-lm's `model.shard`), so no rank holds the whole model.
    `pipeline_group`: keep this rank's layers only (rank 0 the last ones, the last rank the first)."""
    config_path = model_dir / "config.json"
    try:
        config_bytes = config_path.read_bytes()
        config = json.loads(config_bytes)
    except FileNotFoundError:
        raise StatecoreError(
            client_error(f"no model at {model_dir} (no config.json)", Code.MODEL_NOT_FOUND)
        ) from None
    except (OSError, ValueError) as exc:
        raise StatecoreError(client_error(f"cannot read {config_path}: {exc}", Code.MODEL_NOT_FOUND)) from exc
    if not isinstance(config, dict):
        raise StatecoreError(client_error(f"{config_path} is not a JSON object"))
    model_file = config.get("model_file")
    if model_file is not None and not trust_remote_code:
        raise StatecoreError(
            ErrorInfo(
                Fault.UNSUPPORTED,
                Code.UNSUPPORTED_PARAMETER,
                f"model {model_dir.name!r} needs custom Python code (config.json "
                f"model_file={model_file!r}); refusing to run it without trust_remote_code",
            )
        )
    adapter_sha256 = None if adapter_path is None else _adapter_digest(adapter_path)
    if adapter_path is not None and (shard_group is not None or pipeline_group is not None):
        raise StatecoreError(ErrorInfo(
            Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
            "--adapter-path is not served by tensor- or pipeline-parallel instances (their ranks "
            "shard the base layers; the adapter's layers would need sharding too)"))
    if shard_group is not None:
        _check_shardable(config, int(shard_group.size()))
    if pipeline_group is not None and (refusal := pipeline_refusal(
            config.get("model_type"), int(pipeline_group.size()))) is not None:
        raise StatecoreError(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER, refusal))
    try:
        adapter = None if adapter_path is None else str(adapter_path)
        loaded: tuple[Any, ...] = mlx_lm_load(str(model_dir), trust_remote_code=trust_remote_code,
                                              lazy=shard_group is not None or pipeline_group is not None,
                                              adapter_path=adapter)
    except Exception as exc:
        raise StatecoreError(
            ErrorInfo(
                Fault.UNSUPPORTED,
                Code.MODEL_NOT_FOUND,
                f"mlx-lm cannot load {model_dir}: {type(exc).__name__}: {exc}",
            )
        ) from exc
    model, tokenizer = loaded[0], loaded[1]
    if shard_group is not None:
        if not hasattr(model, "shard"):
            raise StatecoreError(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                f"mlx-lm has no tensor-parallel sharding for model type {config.get('model_type')!r} "
                "(--tensor-parallel needs a model class with `shard`: llama, qwen2, qwen3, ...)"))
        model.shard(shard_group)
        mx.eval(model.parameters())
    if pipeline_group is not None:
        inner: Any = getattr(model, "model", None)
        ranks = int(pipeline_group.size())
        if not hasattr(inner, "pipeline"):
            raise StatecoreError(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                                           str(pipeline_refusal(config.get("model_type"), ranks))))
        if len(inner.layers) < ranks:
            raise StatecoreError(client_error(
                f"--pipeline-parallel {ranks} needs at least {ranks} layers; the model has "
                f"{len(inner.layers)}"))
        inner.pipeline(pipeline_group)
        mx.eval(model.parameters())
    eos = {int(t) for t in tokenizer.eos_token_ids}
    raw_eos = config.get("eos_token_id")
    if isinstance(raw_eos, int):
        eos.add(raw_eos)
    elif isinstance(raw_eos, list):
        eos.update(int(t) for t in raw_eos)
    params: Any = tree_flatten(model.parameters())
    dtypes = tuple(sorted({str(v.dtype) for _, v in params}))
    return LoadedModel(model, frozenset(eos), config_bytes, dtypes, _context_length(config), tokenizer,
                       adapter_sha256)


def model_fingerprint(loaded: LoadedModel, *, kv_bits: int | None, kv_group_size: int,
                      prefill_chunk_size: int, shape_bucket: int = 0, fused: bool = False,
                      block_ends: frozenset[int] = frozenset(), message_blocks: str = "all",
                      adapters: Mapping[str, str] | None = None) -> str:
    """What two nodes must share to exchange KV (see the module's paragraph); `adapters` (name ->
    digest of `--adapters`) too: a request's KV depends on its adapter and on what its name means."""
    fields = {
        "format_version": FORMAT_VERSION,
        "config_sha256": hashlib.sha256(loaded.config_bytes).hexdigest(),
        "dtype": ",".join(loaded.dtypes),
        "kv_bits": kv_bits,
        "kv_group_size": kv_group_size if kv_bits is not None else None,
        "prefill_chunk_size": prefill_chunk_size,
        # a prefill block also ends after these tokens (statecore.prefix.block_bounds)
        **({"block_ends": sorted(block_ends), "message_blocks": message_blocks} if block_ends else {}),
        **({"shape_bucket": shape_bucket} if shape_bucket else {}),  # unchanged fingerprints when off
        **({"fused_projections": True} if fused else {}),  # one matmul rounds as three may not
        **({"adapter_sha256": loaded.adapter_sha256} if loaded.adapter_sha256 else {}),
        **({"adapters": dict(adapters)} if adapters else {}),
        # Two BLAS libraries round float32 matmuls differently: nodes on different ones must
        # refuse each other's KV.
        "blas": blas_in_use(),
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _adapter_digest(adapter_path: Path) -> str:
    """The adapter's config and weights, hashed (what the fingerprint carries); refuses a directory
    that is not an mlx-lm adapter."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapters.safetensors"):
        try:
            with (adapter_path / name).open("rb") as stream:
                for block in iter(lambda: stream.read(1 << 20), b""):
                    digest.update(block)
        except OSError as exc:
            raise StatecoreError(client_error(
                f"--adapter-path {adapter_path} is not an mlx-lm adapter directory (it needs "
                f"adapter_config.json and adapters.safetensors): {exc}", Code.MODEL_NOT_FOUND)) from exc
    return digest.hexdigest()


def _check_shardable(config: dict[str, Any], ranks: int) -> None:
    """Each rank takes an equal share of the attention heads, KV heads and MLP columns."""
    source = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(source, dict)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = source.get(key)
        if isinstance(value, int) and value % ranks:
            raise StatecoreError(client_error(
                f"--tensor-parallel {ranks} does not divide the model's {key} ({value})"))


def _context_length(config: dict[str, Any]) -> int:
    for source in (config, config.get("text_config") or {}):
        if not isinstance(source, dict):
            continue
        for key in _CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_CONTEXT_LENGTH
