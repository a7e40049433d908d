"""What the engine's facade asks of its device thread, as values: the engine's command vocabulary.

`MlxEngine` (the `Engine` port, in trio) turns each call into one of these commands, posts it to
the device thread with what only this process holds beside it (`adapters.mlx.jobs.Local`: the
stream a request's tokens go to, its grammar, the caches a payload was built into) and awaits its
outcome; the device thread performs it (`adapters.mlx.performer.Performer.perform`). The same
values are what rank 0 of a tensor- or pipeline-parallel instance broadcasts before each step
(`adapters.mlx.lockstep`), and what each other rank performs on its own shard: the commands that
change what every rank holds are `REPLICATED`; the others (the prefix cache's moves and reads,
a test's look at the device thread) stay on rank 0, which refuses those that would make ranks
differ. A command carries only plain values (ids, tokens, sampling parameters), never KV.
This module is pure: it must never import mlx, trio or httpx.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from effects.engine_port import SamplingParams

__all__ = [
    "REPLICATED", "Cancel", "Command", "DecodeHeld", "EvictPrefixes", "Export", "ExportPrefix",
    "ForgetPrefixes", "Inspect", "Install", "Keep", "Load", "Prefill", "Release", "Replicated", "StagePiece",
    "TakeDevicePiece",
    "Stop", "SummarizePrefixes", "undo_of",
]


@dataclass(frozen=True, slots=True)
class Load:
    """Load the model; `settings` are rank 0's engine settings (every rank must decide alike)."""

    settings: dict[str, Any]
    kind: str = "load"


@dataclass(frozen=True, slots=True)
class Prefill:
    """Queue a prompt for prefill; its outcome (the first token) comes when its last unit is read
    back."""

    request_id: str
    tokens: tuple[int, ...]
    sampling: SamplingParams
    kind: str = "prefill"


@dataclass(frozen=True, slots=True)
class DecodeHeld:
    """Put a request into the decoder from the cache its prefill left held here."""

    request_id: str
    tokens: tuple[int, ...]
    first_token: int
    sampling: SamplingParams
    kind: str = "decode_held"


@dataclass(frozen=True, slots=True)
class Install:
    """Put a request into the decoder from a handed-off cache, built from its payload (or its
    streamed pieces) before the command is posted. `sliced`: a tensor-parallel instance's, each
    other rank receiving only its own heads from rank 0 as the command is performed (point to
    point, not in the plan)."""

    request_id: str
    tokens: tuple[int, ...]
    first_token: int
    sampling: SamplingParams
    sliced: bool = False
    kind: str = "install"


@dataclass(frozen=True, slots=True)
class StagePiece:
    """Write a streamed handoff's piece (its layers from `first_layer`, its tokens from `start`)
    into the slot staged for the request, taking one at its first piece (`adapters.mlx.staging`);
    the outcome says whether it staged (else the caller keeps the piece for the install).
    `needed_tokens`: what the request's slot must hold (prompt, max_tokens and the step's two).
    `in_device_memory`: its arrays lie in the device's own memory (copied device to device), so
    their write is not paced while rows decode (`adapters.mlx.staging`)."""

    request_id: str
    first_layer: int
    start: int
    prompt_tokens: int
    needed_tokens: int
    in_device_memory: bool = False
    kind: str = "stage_piece"


@dataclass(frozen=True, slots=True)
class TakeDevicePiece:
    """Read a streamed handoff's piece out of the sender's GPU memory into arrays of this engine's
    own, and build its caches (`adapters.mlx.device_pieces.take`); `piece` is its checked
    document (`DevicePiece`: where the bytes lie, their shapes; plain values, no KV). With
    `stage`, the same job writes them into the request's slot (one wait for the device loop a
    piece, not two); the outcome is then None when they staged, else the caches to keep."""

    piece: object
    request_id: str  # whose piece: its read is settled before the request's install is answered
    stage: StagePiece | None = None
    kind: str = "take_device_piece"


@dataclass(frozen=True, slots=True)
class Cancel:
    """Drop a request wherever it is (waiting, held or decoding); also what undoes a command whose
    caller left."""

    request_id: str
    kind: str = "cancel"


@dataclass(frozen=True, slots=True)
class Release:
    """Free a held cache (it was exported, or will not be)."""

    request_id: str
    kind: str = "release"


@dataclass(frozen=True, slots=True)
class Export:
    """A held cache as host tensors (on an instance every rank takes part in gathering its heads)."""

    request_id: str
    kind: str = "export"


@dataclass(frozen=True, slots=True)
class ForgetPrefixes:
    """Empty the prefix cache, the memory cap's counters and the measured step rates (after the
    load's warm-up request)."""

    kind: str = "forget_prefixes"


@dataclass(frozen=True, slots=True)
class Keep:
    """Keep another node's prefix-cache blocks of `tokens` (built from its payload beforehand)."""

    tokens: tuple[int, ...]
    kind: str = "keep"


@dataclass(frozen=True, slots=True)
class ExportPrefix:
    """A fresh cache of the prefix cache's blocks of `tokens`, as host tensors."""

    tokens: tuple[int, ...]
    kind: str = "export_prefix"


@dataclass(frozen=True, slots=True)
class EvictPrefixes:
    """Forget kept prefix blocks until `nbytes` are freed (or none is left)."""

    nbytes: int
    kind: str = "evict_prefixes"


@dataclass(frozen=True, slots=True)
class SummarizePrefixes:
    """The prefix cache's summary (its blocks' keys) as of now."""

    kind: str = "summarize_prefixes"


@dataclass(frozen=True, slots=True)
class Inspect:
    """Tests only: call `look` on the device thread (a look at, or a change to, its state that no
    port call makes). Never replicated."""

    look: Callable[[], Any]
    kind: str = "inspect"


@dataclass(frozen=True, slots=True)
class Stop:
    """The instance is closing: the other ranks leave their loop."""

    kind: str = "stop"


Replicated = Load | Prefill | DecodeHeld | Install | Cancel | Release | Export | ForgetPrefixes | Stop
REPLICATED = (Load, Prefill, DecodeHeld, Install, Cancel, Release, Export, ForgetPrefixes, Stop)
Command = (Replicated | StagePiece | TakeDevicePiece | Keep | ExportPrefix | EvictPrefixes | SummarizePrefixes
           | Inspect)


def undo_of(command: Command) -> Cancel | None:
    """What undoes a command whose caller left before its outcome: a prefill or a join is
    cancelled (so that nothing it took is leaked), and so is a staged piece (its slot given back);
    the others need no undo."""
    if isinstance(command, (Prefill, DecodeHeld, Install, StagePiece)):
        return Cancel(command.request_id)
    return None
