"""Per-request KV handoff records: a small bounded ring of the recent handoffs on one node.

A prefill node notes how long exporting (encoding) a held cache took and how many bytes it
served; a decode node notes its pull of those bytes (GET sent to the response head, GET sent to
the last byte, response head to the last byte) and the install. The records are read by
operators and benchmarks through `GET /internal/handoffs`; nothing feeds them back into the
loop. They cost a few clock reads and field stores per handoff, never per-token work. This
module uses only the standard library; it must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_CAPACITY = 256


@dataclass(slots=True)
class HandoffRecord:
    """What one node saw of one request's handoff. Fields a node does not measure stay None:
    the prefill node fills `encode_s`, the decode node the pull and `install_s`; both fill the
    byte counts they saw."""

    request_id: str
    role: str
    opened_at: float = field(default_factory=time.time)  # wall clock, to line records up by eye
    wire_bytes: int | None = None  # the KV payload, as served (prefill) or received (decode)
    raw_bytes: int | None = None  # tensor bytes the payload declares in its end frame
    encode_s: float | None = None  # prefill: Engine.export_held, device-thread queueing included
    first_byte_s: float | None = None  # decode: GET sent -> response head (covers the remote encode)
    transfer_s: float | None = None  # decode: GET sent -> last byte received
    body_s: float | None = None  # decode: response head -> last byte received (the bytes in flight)
    install_s: float | None = None  # decode: Engine.install (validate, rebuild, join the batch)
    # prefill: the decode node's cached prefix pulled before the prefill (route prefill_node_prefix)
    prefix_pull_tokens: int | None = None  # prompt tokens kept from it
    prefix_pull_bytes: int | None = None
    prefix_pull_s: float | None = None  # the pull and the import into the prefix cache
    # a streamed handoff (the KV sent while the prompt is computed)
    streamed: bool = False
    transport: str | None = None  # how the tensor bytes moved: "http", "shm" or "gpu"
    attached: bool = False  # the router started the prefill; the decode node attached to its stream
    segments: int | None = None  # pieces sent (prefill) or received (decode)
    stream_s: float | None = None  # decode: stream opened -> its end (the prefill included)
    first_token_s: float | None = None  # decode: stream opened -> the first token arrived
    overlap: float | None = None  # decode: share of the KV bytes that arrived before the first token
    first_to_second_s: float | None = None  # decode: the first token passed on -> the second token out
    # the handoff's overhead, on one host's wall clock: prefill done (prefill node) -> installed
    # in the decode node's batch (decode node); the prefill's own time beside it
    prefill_s: float | None = None  # prefill: Engine.prefill, queueing included
    prefill_done_at: float | None = None  # prefill: wall clock when the first token was sampled
    installed_at: float | None = None  # decode: wall clock when the request joined the batch


class HandoffLog:
    """The last `capacity` handoffs a node took part in, oldest first.

    `record(request_id)` opens a record or returns the open one, so the pieces of one handoff
    measured in different places (the HTTP client, the performer) land in one record; a reader
    that only looks asks `get`. When full,
    opening a new record drops the oldest: memory stays bounded whatever the traffic.
    """

    def __init__(self, role: str, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.role = role
        self.capacity = capacity
        self._records: OrderedDict[str, HandoffRecord] = OrderedDict()
        self.total = 0  # records ever opened, so a reader can tell how many fell off

    def record(self, request_id: str) -> HandoffRecord:
        found = self._records.get(request_id)
        if found is not None:
            return found
        opened = HandoffRecord(request_id, self.role)
        self._records[request_id] = opened
        self.total += 1
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)
        return opened

    def get(self, request_id: str) -> HandoffRecord | None:
        """The request's record, if the ring still holds one, without opening one: what a reader
        asks (opening one for it would count a handoff that never happened and push out a newer
        record)."""
        return self._records.get(request_id)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy: the role, the counts, and the records oldest first."""
        return {
            "role": self.role,
            "capacity": self.capacity,
            "total": self.total,
            "records": [asdict(r) for r in self._records.values()],
        }


__all__ = ["DEFAULT_CAPACITY", "HandoffLog", "HandoffRecord"]
