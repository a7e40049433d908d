"""The load on the device thread: a model (its draft model, its adapters, its fused projections)
onto the device loop, and what it found.

`load_on_device` reads the model (`adapters.mlx.loading`), sends a one-token probe through the real
prefill path (the cache classes as they travel, the true vocabulary), measures what a token of KV
costs for admission, sets the loop up for it (`adapters.mlx.loop_setup.configure`), builds its
grammars, warms the prefill shapes on a GPU, and returns the model's `ModelInfo`, its cache classes
and grammars (`Loaded`) for the performer to keep. `ModelSource` is what the load reads. Only the
device thread calls it (every rank of an instance alike). This module imports mlx and mlx-lm; it
must never import trio, and statecore and effects never import it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from adapters.grammar import Grammars
from adapters.kv import codec
from adapters.mlx import device_pieces, device_read
from adapters.mlx.device import DeviceLoop
from adapters.mlx.distributed import TensorGroup, agree_max, every_rank
from adapters.mlx.draft_model import DraftModel, check_draft_vocabulary
from adapters.mlx.fusion import fuse_projections
from adapters.mlx.loading import load_model, model_fingerprint
from adapters.mlx.loop_setup import configure
from adapters.mlx.lora_rows import serve_adapters
from adapters.mlx.memory import KvCost, measure_kv_cost, parameter_bytes, state_bytes
from adapters.mlx.prefill import enabled_on_cuda, warm_chunk_shapes
from adapters.mlx.settings import Settings
from effects.engine_port import ModelInfo
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = ["Loaded", "ModelSource", "load_on_device"]

logger = logging.getLogger("adapters.engine_mlx")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What the load reads (`MlxEngine.load`'s arguments of the same meaning): the model directory,
    whether its custom code may run (a config.json naming a `model_file`, custom Python, is refused
    unless `trust_remote_code`), a draft model, an mlx-lm adapter to apply (`adapter_dir`: its
    adapter_config.json and adapters.safetensors, applied at load as mlx-lm applies it), the LoRA
    adapters a request may name (`adapters`, `--adapters`: (name, directory); `SamplingParams.adapter`,
    computed per row beside the base model, `adapters.mlx.lora_rows`), and the instance this process
    is a rank of (None: alone). The adapters' names and bytes are part of the fingerprint, so KV
    moves only between nodes with the same ones. A cache class that cannot travel is logged, not
    refused: `ModelInfo.can_travel` tells the serving roles whether handoffs are possible."""

    model_dir: Path
    trust_remote_code: bool = False
    draft_dir: Path | None = None
    adapter_dir: Path | None = None
    tensor: TensorGroup | None = None
    adapters: tuple[tuple[str, Path], ...] = ()


@dataclass(frozen=True, slots=True)
class Loaded:
    """What the load found: the model's info, each cache layer's class (as a payload must carry
    them) and the grammars of structured output."""

    info: ModelInfo
    classes: list[str]
    grammars: Grammars


def load_on_device(device: DeviceLoop, source: ModelSource, settings: Settings) -> Loaded:
    """Load the model under rank 0's `settings` onto `device` and measure what admission needs
    of it; what it found."""
    s = device.settings = settings
    tensor = source.tensor
    pipelined = tensor is not None and tensor.pipeline
    group = None if tensor is None else tensor.group
    loaded = load_model(source.model_dir, trust_remote_code=source.trust_remote_code,
                        shard_group=None if pipelined else group,
                        pipeline_group=group if pipelined else None, adapter_path=source.adapter_dir)
    device.pipelined = pipelined
    served = serve_adapters(loaded.model, source.adapters, tensor is not None)  # before fusing
    fused = fuse_projections(loaded.model) if enabled_on_cuda(s.fuse_projections) else 0
    device.model = loaded.model
    # A one-token probe through the real prefill path: the cache classes as they travel
    # (QuantizedKVCache when kv_bits is set) and the true vocabulary size.
    try:
        with mx.stream(generation_stream):
            probe_cache: list[Any] = make_prompt_cache(loaded.model)
            logits = loaded.model(mx.array([[0]]), cache=probe_cache)
            device.quantize(probe_cache)
            mx.eval(logits, [c.state for c in probe_cache])
    except Exception as exc:
        raise StatecoreError(ErrorInfo(
            Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE,
            f"model {source.model_dir.name!r} cannot prefill with kv_bits={s.kv_bits}: "
            f"{type(exc).__name__}: {exc}",
        )) from exc
    vocab_size = int(logits.shape[-1])
    layers = tuple(codec.travel_report(probe_cache))
    classes = [layer.class_name for layer in layers]
    for layer in layers:
        if layer.can_travel:
            logger.debug("layer %d: %s can travel", layer.index, layer.class_name)
        else:
            logger.warning("layer %d: %s cannot travel: %s", layer.index, layer.class_name, layer.reason)

    def probe(tokens: int) -> list[Any]:
        with mx.stream(generation_stream):
            cache: list[Any] = make_prompt_cache(loaded.model)
            loaded.model(mx.array([[0] * tokens]), cache=cache)
            device.quantize(cache)
            mx.eval([c.state for c in cache])
        return cache

    travels = all(layer.can_travel for layer in layers)
    cost = measure_kv_cost(probe, codec.raw_tensor_bytes if travels else state_bytes,
                           probe_cache if device.plain(probe_cache) else None)
    if pipelined:  # each rank holds other layers: admission decides alike on the largest
        assert tensor is not None
        cost = KvCost(*agree_max(tensor.group, [cost.fixed, cost.per_token, cost.slot_per_token]))
    if source.draft_dir is not None and s.speculative == "draft":
        drafting = load_model(source.draft_dir, trust_remote_code=source.trust_remote_code)
        check_draft_vocabulary(loaded.tokenizer, drafting.tokenizer)
        device.draft_model = DraftModel(drafting.model)
    configure(device, loaded.model, loaded.eos, vocab_size, loaded.context_length, probe_cache, cost,
              adapters=served)
    # what this rank holds of the model (a shard on a tensor-parallel rank), and every rank's
    held = parameter_bytes(loaded.model)
    by_rank = (held,) if tensor is None else tuple(every_rank(tensor.group, held))
    grammars = Grammars(loaded.tokenizer, vocab_size, loaded.eos)
    if device.bucket and mx.default_device() == mx.gpu:
        started = time.perf_counter()
        with mx.stream(generation_stream):
            shapes = warm_chunk_shapes(loaded.model, device.bucket, s.prefill_chunk_size)
        logger.info("warmed %d prefill shapes in %.1f s", shapes, time.perf_counter() - started)
    pieces = tensor is None and device_pieces.enabled()
    if pieces:  # the kernel that reads them built and checked now, not on a handoff's first piece
        device_read.usable()
    info = ModelInfo(
        name=source.model_dir.name,
        fingerprint=model_fingerprint(loaded, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size,
                                      prefill_chunk_size=s.prefill_chunk_size,
                                      shape_bucket=device.bucket, fused=fused > 0,
                                      block_ends=device.block_ends,
                                      message_blocks=s.message_blocks,
                                      adapters=None if served is None else served.fingerprint()),
        context_length=loaded.context_length,
        vocab_size=vocab_size,
        eos_token_ids=loaded.eos,
        prefill_chunk_size=s.prefill_chunk_size,
        layers=layers,
        parameter_bytes_by_rank=by_rank,
        adapters=() if served is None else served.names,
        device_pieces=pieces,
    )
    logger.info(
        "loaded %s (%s, kv_bits=%s, chunk=%d, shape bucket=%d, lane=%s, attention=%s, traced=%s, "
        "fused projection groups=%d): "
        "can_travel=%s; "
        "KV %d bytes + %d per token, "
        "budget %d bytes (%d set aside for %s)",
        info.name, ",".join(loaded.dtypes),
        s.kv_bits, s.prefill_chunk_size, device.bucket, "slots" if device.slot_lane else "batch lane",
        device.attention if device.slot_lane else "-",
        "yes" if device.compiled is not None else "no", fused,
        info.can_travel,
        cost.fixed, cost.per_token, s.kv_memory_bytes, device.pool_reserved,
        f"{s.max_batch} slots of {device.pool.max_capacity} positions" if device.pool else "no slots",
    )
    return Loaded(info, classes, grammars)
