"""A tiny LoRA adapter for a tiny checkpoint, in mlx-lm's layout (`adapter_config.json`,
`adapters.safetensors`), built offline: what `--adapter-path` is tested with.

`build_lora_adapter` gives the model's attention and MLP output projections LoRA layers with
seeded random weights (mlx-lm starts `lora_b` at zero, which would change nothing), strong enough
that greedy answers differ from the base model's. It imports mlx and mlx_lm; nothing under `src/`
may import it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load

__all__ = ["build_lora_adapter"]


def build_lora_adapter(model_dir: Path, out_dir: Path, *, rank: int = 4, scale: float = 2.0,
                       seed: int = 0) -> Path:
    model = load(str(model_dir))[0]
    parameters = {"rank": rank, "scale": scale, "dropout": 0.0,
                  "keys": ["self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"]}
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": parameters}
    linear_to_lora_layers(model, len(model.layers), parameters)
    rng = np.random.default_rng(seed)
    parameters_now: dict[str, mx.array] = {}
    tree_flatten(model.parameters(), destination=parameters_now)
    weights = {}
    for name, value in parameters_now.items():
        if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
            drawn = np.asarray(rng.standard_normal(tuple(value.shape)), dtype=np.float32)
            weights[name] = mx.array(drawn / math.sqrt(value.shape[0])).astype(value.dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), weights)
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return out_dir
