"""Sibling projections of a loaded model computed as one matmul (`fuse_projections`).

On MLX's CUDA backend a decode step of a small batch is bound by launching kernels, not by
arithmetic: each of a layer's seven projections is its own cuBLASLt launch, read from the same
input. A layer's query, key and value projections (and its MLP's gate and up projections) read the
same activations, so their weights are concatenated at load and one matmul computes all of
them; each projection then hands out its slice. mlx-lm's model code is unchanged: the model still
calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)`, and gets the slices of the one product of `x` (a
projection called with another input computes its own slice of the weights). Only plain,
unquantized `nn.Linear` siblings of the same input size, dtype and bias are fused. The products
round as one matmul's do, which can differ from three in the last bits: the node's fingerprint
says whether it fuses. This module imports mlx; never trio, never the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx

__all__ = ["FUSION_MODES", "SIBLINGS", "fuse_projections"]

FUSION_MODES = ("auto", "on", "off")

_LINEAR: Any = importlib.import_module("mlx.nn").Linear  # (mlx.nn has no type information)

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""The attribute names of projections that read the same input in mlx-lm's models."""


class _SharedProduct:
    """One matmul over the concatenated weights; its slices, once each, for one input.

    Not an `nn.Module`: the model's parameter tree keeps no second copy of the weights."""

    def __init__(self, linears: list[Any]) -> None:
        self.weight = mx.concatenate([linear.weight for linear in linears], axis=0)
        has_bias = "bias" in linears[0]
        self.bias = mx.concatenate([linear["bias"] for linear in linears]) if has_bias else None
        sizes = [int(linear.weight.shape[0]) for linear in linears]
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.pending_input: Any = None
        self._slices: list[Any] = []
        self._pending = 0

    def slice_for(self, index: int, x: Any) -> Any:
        if self.pending_input is not x:
            product = x @ self.weight.T if self.bias is None else mx.addmm(self.bias, x, self.weight.T)
            self._slices = [product[..., self.bounds[i] : self.bounds[i + 1]]
                            for i in range(len(self.bounds) - 1)]
            self.pending_input = x
            self._pending = len(self._slices)
        part = self._slices[index]
        self._pending -= 1
        if self._pending <= 0:  # every sibling served: hold nothing between calls
            self.pending_input, self._slices = None, []
        return part

    def alone(self, index: int, x: Any) -> Any:
        weight = self.weight[self.bounds[index] : self.bounds[index + 1]]
        out = x @ weight.T
        if self.bias is not None:
            out = out + self.bias[self.bounds[index] : self.bounds[index + 1]]
        return out


class _Slice:
    """Stands where one projection was: its slice of the shared product. Not an `nn.Module`
    either: set on the model, it is a plain attribute, outside the parameter tree."""

    def __init__(self, shared: _SharedProduct, index: int) -> None:
        self.shared = shared
        self.index = index

    def __call__(self, x: Any) -> Any:
        if self.shared.pending_input is not None and self.shared.pending_input is not x:
            return self.shared.alone(self.index, x)  # a sibling's input is pending: this one differs
        return self.shared.slice_for(self.index, x)


def _fusable(linears: list[Any]) -> bool:
    if not all(type(linear) is _LINEAR for linear in linears):
        return False  # quantized, LoRA or another kind: left alone
    first = linears[0]
    return all(
        linear.weight.shape[1] == first.weight.shape[1]
        and linear.weight.dtype == first.weight.dtype
        and ("bias" in linear) == ("bias" in first)
        for linear in linears
    )


def fuse_projections(model: Any) -> int:
    """Fuse every group of sibling projections in `model` in place; returns how many groups."""
    fused = 0
    for _, module in model.named_modules():
        for names in SIBLINGS:
            linears = [getattr(module, name, None) for name in names]
            if any(linear is None for linear in linears) or not _fusable(linears):
                continue
            shared = _SharedProduct(linears)
            arrays = [shared.weight] + ([] if shared.bias is None else [shared.bias])
            mx.eval(arrays)
            for index, name in enumerate(names):
                setattr(module, name, _Slice(shared, index))
            fused += 1
    return fused
