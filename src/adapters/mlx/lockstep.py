"""What rank 0 of a tensor-parallel instance tells the other ranks before each engine step.

Every rank of a sharded model must issue the same model calls in the same order (each call runs
the shards' collectives), so the ranks run in lockstep: rank 0 (HTTP front end, scheduler)
decides, and before each step broadcasts a `Plan`, the replicated commands it performs before
that step, in order (`adapters.mlx.commands`: the very values its facade posted); the other ranks
perform the same commands on their own device loop and run the same step with their own shard,
discarding its outputs. A command carries only plain values (request id, tokens, sampling
parameters), never KV: an installed payload's heads reach each rank point to point as the
command is performed (`adapters.mlx.distributed`). `encode_plan`/`decode_plan` are the bytes that
travel: a JSON document of the commands after a small preamble. An empty plan encodes as no bytes
(a heartbeat).
This module is pure: it must never import mlx, trio or httpx.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import Any, Final

from adapters.mlx.commands import (
    Cancel,
    DecodeHeld,
    Export,
    ForgetPrefixes,
    Install,
    Load,
    Prefill,
    Release,
    Replicated,
    Stop,
)
from effects.engine_port import KvBytes, SamplingParams

__all__ = ["PLAN_VERSION", "Plan", "decode_plan", "encode_plan"]

PLAN_VERSION: Final[int] = 3  # 3: the commands of adapters.mlx.commands (decode_held, install, cancel)
_MAGIC: Final[bytes] = b"SCLP"
_PREAMBLE = struct.Struct("<4sII")  # magic, version, header length


@dataclass(frozen=True, slots=True)
class Plan:
    commands: tuple[Replicated, ...] = ()


def encode_plan(plan: Plan) -> bytes:
    if not plan.commands:
        return b""
    header: list[dict[str, Any]] = []
    for command in plan.commands:
        fields = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
        if isinstance(command, (Prefill, DecodeHeld, Install)):
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
    commands: list[Replicated] = []
    for fields in header:
        kind = fields.pop("kind")
        if kind in ("prefill", "decode_held", "install"):
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
    "load": Load, "prefill": Prefill, "decode_held": DecodeHeld, "install": Install, "cancel": Cancel,
    "release": Release, "export": Export, "forget_prefixes": ForgetPrefixes, "stop": Stop,
}
