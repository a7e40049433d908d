"""Phases of every machine, one Enum each, and their terminal sets.

A phase is where a request (or a loop, or a peer) is in its life; the transition tables in
`statecore.table` say how it moves. This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum


class RouterPhase(enum.Enum):
    """A request as the router sees it."""

    INTAKE = "intake"
    ROUTED = "routed"
    PREFILLING = "prefilling"
    HANDING_OFF = "handing_off"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PrefillPhase(enum.Enum):
    """A request on a prefill node: compute the cache, hold it until taken or expired."""

    INTAKE = "intake"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class DecodePhase(enum.Enum):
    """A request on a decode node (or a single node, which prefills locally)."""

    INTAKE = "intake"
    PREFILLING_LOCALLY = "prefilling_locally"
    RECEIVING_KV = "receiving_kv"
    INSTALLING = "installing"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class LoopPhase(enum.Enum):
    """A node's serving loop."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


class PeerPhase(enum.Enum):
    """A peer node's health as the router sees it (a circuit breaker)."""

    UNKNOWN = "unknown"
    UP = "up"
    SUSPECT = "suspect"
    DOWN = "down"
    PROBING = "probing"


ROUTER_TERMINAL = frozenset({RouterPhase.DONE, RouterPhase.FAILED, RouterPhase.CANCELLED})
PREFILL_TERMINAL = frozenset({PrefillPhase.DONE, PrefillPhase.FAILED, PrefillPhase.CANCELLED})
DECODE_TERMINAL = frozenset({DecodePhase.DONE, DecodePhase.FAILED, DecodePhase.CANCELLED})
LOOP_TERMINAL = frozenset({LoopPhase.STOPPED})
PEER_TERMINAL: frozenset[PeerPhase] = frozenset()

__all__ = [
    "DECODE_TERMINAL",
    "LOOP_TERMINAL",
    "PEER_TERMINAL",
    "PREFILL_TERMINAL",
    "ROUTER_TERMINAL",
    "DecodePhase",
    "LoopPhase",
    "PeerPhase",
    "PrefillPhase",
    "RouterPhase",
]
