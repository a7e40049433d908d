"""What rank 0 of a tensor-parallel instance tells the other ranks before each engine step.

Every rank of a sharded model must issue the same model calls in the same order (each call runs
the shards' collectives), so the ranks run in lockstep: rank 0 (HTTP front end, scheduler)
decides, and before each step broadcasts a `Plan`, the commands that apply before that step, in
order; the other ranks apply the same commands to their own device loop and run the same step
with their own shard, discarding its outputs. A command carries only plain values (request id,
tokens, sampling parameters), never KV: each rank rebuilds the device work from it, and an
installed payload's heads reach each rank point to point as its job runs
(`adapters.mlx.distributed`). `encode_plan`/`decode_plan` are the bytes that travel: a JSON
document of the commands after a small preamble. An empty plan encodes as no bytes (a heartbeat).
This module is pure: it must never import mlx, trio or httpx.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Any, Final

from effects.engine_port import KvBytes, SamplingParams

__all__ = [
    "PLAN_VERSION", "Command", "Decode", "Drop", "Export", "ForgetPrefixes", "Load", "Plan", "Prefill",
    "Release", "Stop", "decode_plan", "encode_plan",
]

PLAN_VERSION: Final[int] = 2  # 2: no KV payload in a Decode command
_MAGIC: Final[bytes] = b"SCLP"
_PREAMBLE = struct.Struct("<4sII")  # magic, version, header length


@dataclass(frozen=True, slots=True)
class Load:
    """Load the model; `settings` are rank 0's engine settings (every rank must decide alike)."""

    settings: dict[str, Any]
    kind: str = "load"


@dataclass(frozen=True, slots=True)
class Prefill:
    request_id: str
    tokens: tuple[int, ...]
    sampling: SamplingParams
    kind: str = "prefill"


@dataclass(frozen=True, slots=True)
class Decode:
    """Put a request into the decoder: from its held cache, or, `sliced`, from a payload rank 0
    pulled, each rank receiving only its own heads from rank 0 as the job runs (point to point,
    not in the plan)."""

    request_id: str
    tokens: tuple[int, ...]
    first_token: int
    sampling: SamplingParams
    sliced: bool = False
    kind: str = "decode"


@dataclass(frozen=True, slots=True)
class Drop:
    """Cancel a request wherever it is (waiting, held or decoding), or undo a job's effect."""

    request_id: str
    kind: str = "drop"


@dataclass(frozen=True, slots=True)
class Release:
    request_id: str
    kind: str = "release"


@dataclass(frozen=True, slots=True)
class Export:
    """Gather a held cache's heads on rank 0 (every rank takes part in the collective)."""

    request_id: str
    kind: str = "export"


@dataclass(frozen=True, slots=True)
class ForgetPrefixes:
    kind: str = "forget_prefixes"


@dataclass(frozen=True, slots=True)
class Stop:
    """The instance is closing: the other ranks leave their loop."""

    kind: str = "stop"


Command = Load | Prefill | Decode | Drop | Release | Export | ForgetPrefixes | Stop


@dataclass(frozen=True, slots=True)
class Plan:
    commands: tuple[Command, ...] = ()


def encode_plan(plan: Plan) -> bytes:
    if not plan.commands:
        return b""
    header: list[dict[str, Any]] = []
    for command in plan.commands:
        fields = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
        if isinstance(command, (Prefill, Decode)):
            fields["sampling"] = dataclasses.asdict(command.sampling)
            fields["tokens"] = list(command.tokens)
        header.append(fields)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    return _PREAMBLE.pack(_MAGIC, PLAN_VERSION, len(header_bytes)) + header_bytes


def decode_plan(data: KvBytes) -> Plan:
    """The plan `encode_plan` wrote; ValueError when the bytes are not one (a bug: ranks run one build)."""
    view = memoryview(data)
    if not view:
        return Plan()
    if len(view) < _PREAMBLE.size:
        raise ValueError("a lockstep plan shorter than its preamble")
    magic, version, header_len = _PREAMBLE.unpack_from(view)
    if magic != _MAGIC or version != PLAN_VERSION:
        raise ValueError(f"not a lockstep plan of version {PLAN_VERSION} "
                         f"(magic {magic!r}, version {version})")
    offset = _PREAMBLE.size + header_len
    header = json.loads(bytes(view[_PREAMBLE.size:offset]))
    commands: list[Command] = []
    for fields in header:
        kind = fields.pop("kind")
        if kind in ("prefill", "decode"):
            fields["sampling"] = _sampling(fields["sampling"])
            fields["tokens"] = tuple(fields["tokens"])
        commands.append(_KINDS[kind](**fields))
    if offset != len(view):
        raise ValueError(f"a lockstep plan with {len(view) - offset} trailing bytes")
    return Plan(tuple(commands))


def _sampling(fields: dict[str, Any]) -> SamplingParams:
    fields["xtc_special_tokens"] = tuple(fields["xtc_special_tokens"])
    fields["logit_bias"] = tuple((int(t), float(b)) for t, b in fields["logit_bias"])
    return SamplingParams(**fields)


_KINDS: Final[dict[str, type[Any]]] = {
    "load": Load, "prefill": Prefill, "decode": Decode, "drop": Drop, "release": Release,
    "export": Export, "forget_prefixes": ForgetPrefixes, "stop": Stop,
}
