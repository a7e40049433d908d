"""Per-request LoRA adapters (`--adapters NAME=PATH ...`): several mlx-lm LoRA adapters beside one
base model, each request computing with the one it names (`SamplingParams.adapter`), rows of
different adapters in one model call.

`install_adapters` (at load, on the device thread, before projections are fused) reads each
adapter directory as `mlx_lm.lora` writes it (`adapter_config.json`, `adapters.safetensors`; LoRA
only: not DoRA, not a full fine-tune) and puts a `RowLoRALinear` where each projection an adapter
touches was: it holds the base projection and every adapter's `(lora_a, lora_b, scale)` for it.
It is not an `nn.Module` (set on the model it is a plain attribute, as `adapters.mlx.fusion`'s
slices are), so the parameter tree and mlx-lm's model code are unchanged. `AdapterRows` wraps the
model the device loop calls: before each call it reads the request of each row of the call
(`LaneHost.computing`, in the call's row order) and the adapter each one named, and tells the
projections which rows take which adapter (`RowSelection`) while the call's graph is built. A
touched projection computes `y = base(x)` and, for each adapter among the rows,
`y + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)` on that adapter's rows (`mx.where` over a
row mask; no mask when every row takes it): mlx-lm's `LoRALinear` expression, so a request alone
with adapter X computes what a model loaded with `--adapter-path X` computes. Each adapter present
in a call costs its two low-rank matmuls over the whole call. A call whose rows cannot be told
apart (fewer or more requests than rows) while one of them names an adapter raises rather than
compute numbers that are not the request's.
This module imports mlx; it must never import trio or the device loop.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error

__all__ = ["AdapterRows", "AdapterSet", "RowLoRALinear", "RowSelection", "install_adapters", "serve_adapters"]

_LORA_LEAVES = ("lora_a", "lora_b")


@dataclass
class RowSelection:
    """Which rows of the model call being built take which adapter: (adapter index, a (rows, 1,
    1) mask or None for every row). Empty: every row computes the base model."""

    groups: list[tuple[int, Any]] = field(default_factory=list)


class RowLoRALinear:
    """A base projection and each adapter's low-rank update to it (see the module's paragraph)."""

    def __init__(self, base: Any, selection: RowSelection) -> None:
        self.base = base
        self.selection = selection
        self.updates: dict[int, tuple[Any, Any, float]] = {}  # adapter index -> (lora_a, lora_b, scale)

    def __call__(self, x: Any) -> Any:
        y = self.base(x)
        for index, mask in self.selection.groups:
            update = self.updates.get(index)
            if update is None:
                continue
            lora_a, lora_b, scale = update
            adapted = y + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)
            y = adapted if mask is None else mx.where(mask, adapted, y)
        return y


@dataclass(frozen=True)
class AdapterSet:
    """The adapters a node serves, in `--adapters` order (a request names one by `names`), the
    selection their projections read, and each adapter's config and weights hashed (the model
    fingerprint carries them: KV moves only between nodes serving the same set)."""

    names: tuple[str, ...]
    digests: tuple[str, ...]
    selection: RowSelection

    def index(self, name: str) -> int:
        return self.names.index(name)

    def fingerprint(self) -> dict[str, str]:
        return dict(zip(self.names, self.digests, strict=True))


def serve_adapters(model: Any, named: Sequence[tuple[str, Path]], sharded: bool) -> AdapterSet | None:
    """`--adapters` installed in `model` (None when none is named); refused on a tensor- or
    pipeline-parallel rank (its base layers are shards: the adapters' would need sharding too)."""
    if not named:
        return None
    if sharded:
        raise StatecoreError(ErrorInfo(Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                                       "--adapters is not served by tensor- or pipeline-parallel instances"))
    return install_adapters(model, named)


def install_adapters(model: Any, named: Sequence[tuple[str, Path]]) -> AdapterSet:
    """Each adapter's updates beside `model`'s projections (see the module's paragraph); a
    directory that is not an mlx-lm LoRA adapter of this model is refused (StatecoreError)."""
    selection = RowSelection()
    wrapped: dict[str, RowLoRALinear] = {}
    digests = []
    for index, (name, path) in enumerate(named):
        config, weights, digest = _read_adapter(name, path)
        digests.append(digest)
        scale = float(config.get("lora_parameters", {}).get("scale", 20.0))
        paths = sorted({key.rsplit(".", 1)[0] for key in weights})
        for module_path in paths:
            lora_a, lora_b = (weights.get(f"{module_path}.{leaf}") for leaf in _LORA_LEAVES)
            if lora_a is None or lora_b is None:
                raise _refused(name, path, f"{module_path} lacks lora_a or lora_b")
            projection = wrapped.get(module_path)
            if projection is None:
                projection = wrapped[module_path] = _wrap(model, module_path, selection, name, path)
            out_dims, in_dims = _dims(projection.base)
            rank = int(lora_a.shape[-1])
            if tuple(lora_a.shape) != (in_dims, rank) or tuple(lora_b.shape) != (rank, out_dims):
                raise _refused(name, path, f"{module_path}: lora_a {tuple(lora_a.shape)} and lora_b "
                                           f"{tuple(lora_b.shape)} do not fit its {in_dims} -> {out_dims} "
                                           "projection")
            projection.updates[index] = (lora_a, lora_b, scale)
    for projection in wrapped.values():
        mx.eval([array for update in projection.updates.values() for array in update[:2]])
    return AdapterSet(tuple(name for name, _ in named), tuple(digests), selection)


class AdapterRows:
    """The model as the device loop calls it, telling the adapters' projections which rows take
    which adapter for each call (see the module's paragraph). `adapter_of(request id)` is the
    adapter a request named (None: the base model); `computing()` the call's (stage, request id
    of each row) as the lanes set it."""

    def __init__(self, model: Any, adapters: AdapterSet, computing: Callable[[], tuple[str, Sequence[str]]],
                 adapter_of: Callable[[str], str | None]) -> None:
        self._model = model
        self._adapters = adapters
        self._computing = computing
        self._adapter_of = adapter_of

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        selection = self._adapters.selection
        selection.groups = self.groups(int(inputs.shape[0]), self._computing()[1])
        try:
            return self._model(inputs, *args, **kwargs)
        finally:
            selection.groups = []

    def groups(self, rows: int, request_ids: Sequence[str]) -> list[tuple[int, Any]]:
        names = [self._adapter_of(rid) if rid else None for rid in request_ids]
        if not any(names):
            return []
        if len(names) != rows:
            raise RuntimeError(f"a model call of {rows} rows for the requests {list(request_ids)}: "
                               "which rows take which adapter cannot be told")
        groups = []
        for name in dict.fromkeys(n for n in names if n is not None):
            takes = [n == name for n in names]
            mask = None if all(takes) else mx.array(takes)[:, None, None]
            groups.append((self._adapters.index(name), mask))
        return groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _read_adapter(name: str, path: Path) -> tuple[dict[str, Any], dict[str, Any], str]:
    digest = hashlib.sha256()
    try:
        config_bytes = (path / "adapter_config.json").read_bytes()
        weights_file = path / "adapters.safetensors"
        with weights_file.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
        config = json.loads(config_bytes)
    except (OSError, ValueError) as exc:
        raise _refused(name, path, f"not an mlx-lm adapter directory (it needs adapter_config.json and "
                                   f"adapters.safetensors): {exc}") from None
    digest.update(config_bytes)
    if not isinstance(config, dict):
        raise _refused(name, path, "adapter_config.json is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise _refused(name, path, f"a {kind} adapter: --adapters serves LoRA adapters (--adapter-path "
                                   "applies any mlx-lm adapter to every request)")
    weights: Mapping[str, Any] = mx.load(str(weights_file))  # type: ignore[assignment]
    odd = sorted(key for key in weights if key.rsplit(".", 1)[-1] not in _LORA_LEAVES)
    if odd:
        raise _refused(name, path, f"weights that are not LoRA's: {', '.join(odd[:3])}")
    return config, dict(weights), digest.hexdigest()


def _wrap(model: Any, module_path: str, selection: RowSelection, name: str, path: Path) -> RowLoRALinear:
    parent: Any = model
    *parents, attribute = module_path.split(".")
    try:
        for part in parents:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        base = getattr(parent, attribute)
    except (AttributeError, IndexError, KeyError):
        raise _refused(name, path, f"the model has no projection {module_path}") from None
    if type(base).__name__ not in ("Linear", "QuantizedLinear"):
        raise _refused(name, path, f"{module_path} is a {type(base).__name__}: LoRA on Linear layers only")
    projection = RowLoRALinear(base, selection)
    setattr(parent, attribute, projection)  # a plain attribute: the parameter tree keeps the base
    return projection


def _dims(linear: Any) -> tuple[int, int]:
    out_dims, in_dims = (int(d) for d in linear.weight.shape)
    bits = getattr(linear, "bits", None)
    return out_dims, in_dims * 32 // int(bits) if bits else in_dims


def _refused(name: str, path: Path, why: str) -> StatecoreError:
    return StatecoreError(client_error(f"--adapters {name}={path}: {why}", Code.MODEL_NOT_FOUND))
