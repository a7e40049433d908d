"""A real failure on the device, for tests: a term that raises when MLX evaluates it (an LU
factorization of a singular matrix), added to the attention of the model calls a test picks (of
llama, or of another mlx-lm model module that calls mlx-lm's attention function).
The failure comes at evaluation, after a step's graph (and the lazy updates of the caches it
writes) was built, as a kernel that fails at launch does (MLX's masked attention did for a verify
row of head dim 16 on CUDA): not a raise from Python while the graph is built."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from adapters.mlx.attention import route_attention

__all__ = ["FailingAttention"]


class FailingAttention:
    """The llama's attention with, while `when()`, a term that raises when the device computes it;
    `fired` counts the model calls' layers that took it. The failed kernel's output is read back
    as it was left (zeros on the CPU): with `leaves_nan` the term divides by it, so what the
    failed step computed after it (the keys and values it wrote) is NaN, as a kernel that
    failed part-way leaves garbage; else the term is 0 whatever it left."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, when: Callable[[], bool], *,
                 leaves_nan: bool = False, module: ModuleType = llama) -> None:
        self.fired = 0
        route_attention()  # routed first: the wrapper stands where the routed function stood
        self.inner: Callable[..., Any] = module.__dict__["scaled_dot_product_attention"]

        def attention(*args: Any, **kwargs: Any) -> Any:
            out = self.inner(*args, **kwargs)
            if not when():
                return out
            self.fired += 1
            failing = mx.linalg.inv(mx.zeros((2, 2)), stream=mx.cpu).sum()
            term = 0 * failing / failing if leaves_nan else 0 * failing
            return out + term.astype(out.dtype)

        attention.statecore_routed = True  # type: ignore[attr-defined]
        monkeypatch.setattr(module, "scaled_dot_product_attention", attention)
