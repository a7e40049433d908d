"""A tiny llama that mostly continues a fixed chain of tokens: speculative decoding's test and
benchmark model.

`build_chain_checkpoint` writes `support.tiny_models`' random llama with a bigram table added to
its output layer: after token t the model favours `chain_next(t)` (a fixed permutation of the
ordinary tokens), strongly enough that greedy decoding follows the chain most of the time and
the random layers (attention over the whole context) still decide some tokens. A prompt that
holds the chain from its last token on is then a prompt that holds most of the answer (as in
code editing), and prompt lookup drafts it; a prompt without it is like a chat. It imports mlx
and `support.tiny_models`; nothing under `src/` may import it.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from support.tiny_models import TOKENIZER_VOCAB_SIZE, build_tiny_checkpoint

__all__ = ["FIRST_ORDINARY", "build_chain_checkpoint", "chain", "chain_next"]

FIRST_ORDINARY = 8  # ids below are the tokenizers' special tokens: the chain never visits them
_CHAIN_SEED = 1234


def _successors() -> np.ndarray:
    order = np.random.default_rng(_CHAIN_SEED).permutation(np.arange(FIRST_ORDINARY, TOKENIZER_VOCAB_SIZE))
    successor = np.arange(TOKENIZER_VOCAB_SIZE)
    successor[order] = np.roll(order, -1)  # one cycle through every ordinary token
    return successor


def chain_next(token: int) -> int:
    return int(_successors()[token])


def chain(start: int, length: int) -> list[int]:
    """`length` tokens of the chain, from `start` on."""
    successor = _successors()
    out = [start]
    while len(out) < length:
        out.append(int(successor[out[-1]]))
    return out


def build_chain_checkpoint(out_dir: Path, *, strength: float = 6.0, layer_gain: float = 0.3,
                           hidden_size: int = 64, num_layers: int = 2, dtype: str = "float32",
                           head_dim: int = 16) -> Path:
    """The random llama of `build_tiny_checkpoint` with `strength` x a bigram table of the chain
    added to lm_head (row chain_next(t) gains token t's unit embedding direction), its layers'
    output projections scaled by `layer_gain` so that the token's own embedding leads the last
    hidden state and the layers only sometimes overrule the table. `head_dim`: its attention
    heads' width (16; a GPU benchmark's 64 or 128, the widths MLX's CUDA kernels take)."""
    build_tiny_checkpoint(out_dir, "llama", hidden_size=hidden_size, num_layers=num_layers, dtype=dtype,
                          head_dim=head_dim)
    path = str(Path(out_dir) / "model.safetensors")
    weights = dict(mx.load(path).items())  # type: ignore[union-attr]
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * layer_gain
    embed = np.array(weights["model.embed_tokens.weight"].astype(mx.float32))
    head = np.array(weights["lm_head.weight"].astype(mx.float32))
    successor = _successors()
    units = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    ordinary = np.arange(FIRST_ORDINARY, TOKENIZER_VOCAB_SIZE)
    head[successor[ordinary]] += strength * units[ordinary] * np.sqrt(hidden_size) / 8
    weights["lm_head.weight"] = mx.array(head).astype(getattr(mx, dtype))
    mx.save_safetensors(path, weights, metadata={"format": "mlx"})
    return Path(out_dir)
