"""The device loop's one record per request (`EngineRequest`) and the table that holds them.

A request the engine knows has exactly one record here, from its registration (a prompt queued
for prefill, a keep task, a handed-off cache joining the decoder) until it leaves (it ended, was
cancelled, released or failed): its phase, the lane it decodes in, the KV bytes it has reserved,
and the device objects of its phase (its prefill task, its held cache, its decoding row), and when it
leaves, its finish (`statecore.engine_schedule.Finish`: the one way out, `remove`, names it). The
maps the loop reads (waiting prompts, held caches, decoding rows, reservations, choices
gathering) are read-only views of this table (`RequestTable.waiting`, `held`, `live`,
`reserved`, `gathering`), so no two of them can disagree. The phases are the core's
(`statecore.engine_schedule.EnginePhase`). Only the device thread reads or changes it. MLX types
only through the objects it holds; it must never import trio (but for the types of `Live`), the
device loop or the engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from adapters.mlx.prefill import PrefillTask
from adapters.mlx.rows import Live
from effects.engine_port import SamplingParams
from statecore.engine_schedule import EnginePhase, Finish

__all__ = ["EngineRequest", "Held", "RequestTable"]


PREFILL_PHASES = frozenset({EnginePhase.WAITING, EnginePhase.PREFILLING, EnginePhase.KEEPING})
DECODER_PHASES = frozenset({EnginePhase.GATHERING, EnginePhase.RUNNING})


@dataclass(eq=False)
class Held:
    """A prefilled cache waiting for its export or its local decode."""

    cache: list[Any]
    prompt_tokens: int
    nbytes: int
    sampling: SamplingParams | None = None  # the request's (a choice of n > 1 is waited for)
    # The tokens its prompt's last call emitted when that call verified drafts (the first token
    # first, `adapters.mlx.first_verify.FirstVerify`): the cache covers the prompt and all of them
    # but the last. Empty: the first token alone, the cache the prompt's.
    drawn: tuple[int, ...] = ()

    def cut_to_prompt(self) -> None:
        """Forget the tokens after the first: the cache covers the prompt alone again (for a
        handoff, or a decode that starts from another first token)."""
        if len(self.drawn) > 1:  # (only plain KVCache layers draft)
            for layer in self.cache:
                layer.trim(len(self.drawn) - 1)
        self.drawn = ()


@dataclass(eq=False)
class EngineRequest:
    """One request as the device loop knows it (see the module's paragraph). `task` is set while
    it prefills (and kept while its first token is read back), `held` while it is held, `live`
    while it is in the decoder; `arrived` is what a gathering choice enters its lane with."""

    request_id: str
    phase: EnginePhase
    reserved: int = 0  # KV bytes set aside for its own cache (outside the slot pool)
    lane: str | None = None  # "slot", "batch" or "solo" once it joins the decoder
    task: PrefillTask | None = None
    held: Held | None = None
    live: Live | None = None
    arrived: tuple[list[Any], list[int]] | None = None  # gathering: (its prompt's cache, the prompt)
    finish: Finish | None = None  # how it left the table (set as it leaves)

    @property
    def units_done(self) -> int:
        return 0 if self.task is None else self.task.done_units

    @property
    def sampling(self) -> SamplingParams | None:
        if self.live is not None:
            return self.live.sampler.sampling
        if self.task is not None:
            return self.task.sampler.sampling
        return None if self.held is None else self.held.sampling


class _View(Mapping[str, Any]):
    """A read-only map of the table's records in some phases, by request id, in table order."""

    def __init__(self, table: RequestTable, phases: frozenset[EnginePhase], attribute: str) -> None:
        self._table = table
        self._phases = phases
        self._attribute = attribute

    def _pick(self, record: EngineRequest | None) -> Any:
        if record is None or record.phase not in self._phases:
            return None
        return getattr(record, self._attribute)

    def __getitem__(self, request_id: str) -> Any:
        value = self._pick(self._table.get(request_id))
        if value is None:
            raise KeyError(request_id)
        return value

    def __iter__(self) -> Iterator[str]:
        return (rid for rid, record in self._table.items() if self._pick(record) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class RequestTable:
    """Every request's record, by request id, in the order they came (a request that joins the
    decoder moves to the end: the decoder's rows are in joining order)."""

    def __init__(self) -> None:
        self._records: dict[str, EngineRequest] = {}
        self.finished: Counter[Finish] = Counter()  # the records that left, by finish
        self.waiting: Mapping[str, PrefillTask] = _View(self, PREFILL_PHASES, "task")
        self.held: Mapping[str, Held] = _View(self, frozenset({EnginePhase.HELD}), "held")
        self.live: Mapping[str, Live] = _View(self, DECODER_PHASES, "live")
        self.gathering: Mapping[str, Live] = _View(self, frozenset({EnginePhase.GATHERING}), "live")

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, request_id: str) -> EngineRequest:
        return self._records[request_id]

    def get(self, request_id: str) -> EngineRequest | None:
        return self._records.get(request_id)

    def items(self) -> Iterator[tuple[str, EngineRequest]]:
        return iter(list(self._records.items()))

    def records(self) -> list[EngineRequest]:
        return list(self._records.values())

    def in_phase(self, *phases: EnginePhase) -> list[EngineRequest]:
        return [record for record in self._records.values() if record.phase in phases]

    def add(self, record: EngineRequest) -> EngineRequest:
        """Put a record in (replacing one of the same id), at the end."""
        self._records.pop(record.request_id, None)
        self._records[record.request_id] = record
        return record

    def remove(self, request_id: str, finish: Finish) -> EngineRequest | None:
        """The request leaves (its reservation with it): its record, with its finish, or None
        when it had none."""
        record = self._records.pop(request_id, None)
        if record is not None:
            record.finish = finish
            self.finished[finish] += 1
        return record

    def clear(self, finish: Finish) -> None:
        """Every request leaves with `finish`."""
        for request_id in list(self._records):
            self.remove(request_id, finish)

    @property
    def reserved(self) -> dict[str, int]:
        """Each request's own KV bytes (outside the slot pool), those that reserved any."""
        return {rid: record.reserved for rid, record in self._records.items() if record.reserved}

    @property
    def reserved_bytes(self) -> int:
        return sum(record.reserved for record in self._records.values())

    def reserved_by(self, request_id: str) -> int:
        record = self._records.get(request_id)
        return 0 if record is None else record.reserved

    def unreserve(self, request_id: str) -> None:
        record = self._records.get(request_id)
        if record is not None:
            record.reserved = 0

    def hold(self, request_id: str, held: Held) -> EngineRequest:
        """A prefill's cache computed and read back: held (a record dropped meanwhile comes back
        without its reservation, as a held cache the caller releases)."""
        record = self._records.get(request_id)
        if record is None:
            record = self.add(EngineRequest(request_id, EnginePhase.HELD))
        record.phase, record.held = EnginePhase.HELD, held
        return record

    def join(self, live: Live, lane: str, gathering: tuple[list[Any], list[int]] | None) -> EngineRequest:
        """A request enters the decoder (its lane, or first its siblings' gathering): its record,
        made when it has none (an installed cache), moves to the end; its held cache and prefill
        task are no longer its."""
        record = self._records.pop(live.request_id, None)
        if record is None:
            record = EngineRequest(live.request_id, EnginePhase.RUNNING)
        self._records[live.request_id] = record
        record.phase = EnginePhase.RUNNING if gathering is None else EnginePhase.GATHERING
        record.live, record.lane, record.arrived = live, lane, gathering
        record.held = record.task = None
        return record
