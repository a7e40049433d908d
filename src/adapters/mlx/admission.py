"""KV admission on the device thread: whether a request's own KV cache fits this node's budget now,
later, or never, and what gives way to it (kept prefix blocks, then keep tasks), as far as it
needs and only when that makes it fit (`statecore.engine_schedule.admission` decides; this
performs it); what a new prompt reserves; the room the budget leaves for kept prefixes; the
decoder's row limit. It reads the device loop's records and budgets and changes only the prefix
cache's and the keep tasks' share; it must never import trio, and sees the loop only as an
`AdmissionHost`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from adapters.mlx.keeping import PrefixKeeping
from adapters.mlx.memory import KvCost
from adapters.mlx.prefix_cache import PrefixCache
from adapters.mlx.requests import RequestTable
from adapters.mlx.settings import Settings
from adapters.mlx.slot_lane import SlotLane
from adapters.mlx.slots import SlotPool
from statecore.engine_schedule import EnginePhase, admission
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.scheduling import KvAdmission

__all__ = ["Admission", "AdmissionHost"]


class AdmissionHost(Protocol):
    """What admission needs of the device loop."""

    settings: Settings
    requests: RequestTable
    live: Mapping[str, Any]  # the requests in the decoder
    prefix: PrefixCache | None
    keeping: PrefixKeeping
    pool: SlotPool | None
    slots: SlotLane  # its staged slots count against max_batch
    pool_reserved: int
    cost: KvCost


class Admission:
    """A device loop's admission of KV (see the module's paragraph)."""

    def __init__(self, loop: AdmissionHost) -> None:
        self.loop = loop

    def admit(self, request_id: str, need: int, tokens: int) -> int:
        """Make room for `need` bytes of the request's own KV cache (replacing what its record
        reserves) and return it for the caller to put on the record, or raise: OVERLOADED when it
        fits once others leave, KV_MEMORY_EXCEEDED when it never fits. Kept prefixes, then keep
        tasks, give way to it, as far as it needs, and only when that makes it fit: a request
        refused anyway takes nothing from them."""
        loop = self.loop
        requests, pool_reserved, prefix = loop.requests, loop.pool_reserved, loop.prefix
        budget = loop.settings.kv_memory_bytes
        others = requests.reserved_bytes - requests.reserved_by(request_id)
        keeping = sum(record.reserved for record in requests.in_phase(EnginePhase.KEEPING))
        kept = 0 if prefix is None else prefix.nbytes
        decided = admission(need, others, keeping, pool_reserved, kept, budget)
        verdict = decided.verdict
        if decided.drop_keep_tasks:
            loop.keeping.drop_keep_tasks()
        if verdict is KvAdmission.FITS and prefix is not None:
            prefix.evict(decided.evict_prefix_bytes)
        if verdict is KvAdmission.NEVER:
            raise self.never_fits(need, tokens)
        if verdict is KvAdmission.LATER:
            raise StatecoreError(ErrorInfo(
                Fault.OVERLOADED, Code.OVERLOADED,
                f"KV memory is taken by live requests ({others:,} of {budget - pool_reserved:,} "
                f"bytes); this one needs {need:,}: try again shortly",
            ))
        return need

    def prefix_room(self) -> int:
        """What the KV budget leaves beside requests' reservations, the slot pool's share and the
        kept prefix blocks: the most host blocks coming back may add (adapters.mlx.prefix_cache)."""
        loop = self.loop
        kept = 0 if loop.prefix is None else loop.prefix.nbytes
        return loop.settings.kv_memory_bytes - loop.requests.reserved_bytes - loop.pool_reserved - kept

    def prefill_reservation(self, prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
        """(bytes, tokens) a new prompt reserves: its own cache, and on a node that decodes it,
        the whole request's when it will decode outside the slot layout (a slot is set aside)."""
        loop = self.loop
        total = prompt_tokens + max_tokens
        fits_a_slot = loop.pool is not None and total + 2 <= loop.pool.max_capacity
        if loop.settings.decodes_locally and not fits_a_slot:
            return loop.cost.of(total), total
        return loop.cost.of(prompt_tokens), prompt_tokens

    def never_fits(self, need: int, tokens: int) -> StatecoreError:
        budget, pool_reserved = self.loop.settings.kv_memory_bytes, self.loop.pool_reserved
        aside = f", {pool_reserved:,} set aside for the slot layout" if pool_reserved else ""
        return StatecoreError(ErrorInfo(
            Fault.CLIENT, Code.KV_MEMORY_EXCEEDED,
            f"this request's KV cache ({tokens} tokens) needs up to {need:,} bytes; this node's KV "
            f"budget is {budget:,} bytes (--kv-memory-bytes){aside}: ask for fewer tokens",
        ))

    def overloaded(self) -> StatecoreError | None:
        """Whether one more request may decode: every one decoding, or staged for its slot,
        counts against --max-batch."""
        decoding, arriving = len(self.loop.live), len(self.loop.slots.staged)
        max_batch = self.loop.settings.max_batch
        if decoding + arriving >= max_batch:
            return StatecoreError(ErrorInfo(
                Fault.OVERLOADED, Code.OVERLOADED,
                f"{decoding} requests are decoding and {arriving} arriving (max_batch {max_batch})",
            ))
        return None
