"""Where a stream's gap between tokens is made: the same streams' gaps at each hop, in one unit.

`handoff_overhead.py --background-streams N` (and `disagg_equal.py`) read every node's
`GET /internal/token_times` after the run: per request, when the decode node's loop applied each
step's tokens (`applied`: the engine's step, handed over), when its node API took each NDJSON line
to write (`read`), and the same two on the router (the line read from the decode node; the SSE chunk
taken to write), and the client's own arrival times. For each hop this module computes the gaps
between consecutive tokens of one request, splits them into those that overlap a handoff window and
the others, and gives p99 and max of each in the decode engine's median step outside the windows
(so a hop that adds jitter shows it against the same unit), and per window the longest gap in the
streams' steps after the join (the bench's "joined steps").

Bench code: it may import anything; nothing under src/ imports it. Its figures are tested in
`tests/unit/test_hop_gaps.py`.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence

Gap = tuple[float, float]  # (start, end): two consecutive tokens of one request
Window = tuple[float, float]
# the hops in the order a token passes them; names as the bench prints them
HOPS = ("decode applied", "decode read", "router applied", "router read", "client")


def gaps_of(times: Mapping[str, Sequence[float]]) -> list[Gap]:
    """Every gap between two consecutive tokens of one request (a step's several tokens, one
    moment repeated, make gaps of 0: they came together)."""
    return [(a, b) for moments in times.values() for a, b in itertools.pairwise(moments)]


def overlaps(gap: Gap, windows: Iterable[Window]) -> bool:
    return any(gap[1] > start and gap[0] < end for start, end in windows)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def step_outside(gaps: Sequence[Gap], windows: Sequence[Window]) -> float | None:
    """The median gap outside every window (the batch's plain step); None when there is none."""
    quiet = [b - a for a, b in gaps if not overlaps((a, b), windows)]
    return statistics.median(quiet) if quiet else None


def figures(gaps: Sequence[Gap], windows: Sequence[Window], step_s: float,
            busy: Sequence[Window] = ()) -> dict[str, float | int | None]:
    """p99 and max of the gaps inside the windows (overlapping one) and outside all of them, in
    `step_s`, and how many there were; and of those outside, the ones overlapping a `busy` span
    (e.g. a prefill computing on the clients' core) apart from the rest ("busy", "idle")."""
    inside = [b - a for a, b in gaps if overlaps((a, b), windows)]
    outside = [(a, b) for a, b in gaps if not overlaps((a, b), windows)]
    groups = {"in": inside, "out": [b - a for a, b in outside]}
    if busy:
        groups["busy"] = [b - a for a, b in outside if overlaps((a, b), busy)]
        groups["idle"] = [b - a for a, b in outside if not overlaps((a, b), busy)]
    out: dict[str, float | int | None] = {f"n_{name}": len(values) for name, values in groups.items()}
    for name, values in groups.items():
        out[f"p99_{name}"] = percentile(values, 99) / step_s if values else None
        out[f"max_{name}"] = max(values) / step_s if values else None
    return out


def joined_stall(gaps: Sequence[Gap], window: Window, after_join_s: float = 1.0) -> float | None:
    """The longest gap overlapping `window` over the median gap that lies in the last
    `after_join_s` of it (the window ends that long after the join): None when none lies there."""
    joined = window[1] - after_join_s
    after = [b - a for a, b in gaps if a >= joined and b <= window[1]]
    step = statistics.median(after) if after else 0.0
    if step <= 0.0:
        return None
    longest = max((b - a for a, b in gaps if b > window[0] and a < window[1]), default=0.0)
    return longest / step


def by_hop(hops: Mapping[str, Mapping[str, Sequence[float]]], windows: Sequence[Window],
           busy: Sequence[Window] = ()) -> dict[str, dict[str, float | int | None]]:
    """Per hop (`HOPS`' names, those given), `figures` in the decode engine's median step outside
    the windows ("decode applied"; else the first hop given), and the median and max over the
    windows of `joined_stall`."""
    gaps = {hop: gaps_of(times) for hop, times in hops.items()}
    unit_hop = "decode applied" if "decode applied" in gaps else next(iter(gaps), None)
    step = None if unit_hop is None else step_outside(gaps[unit_hop], windows)
    out: dict[str, dict[str, float | int | None]] = {}
    if not step:
        return out
    for hop in [h for h in HOPS if h in gaps] + [h for h in gaps if h not in HOPS]:
        row = figures(gaps[hop], windows, step, busy)
        row["step_ms"] = step * 1e3
        stalls = [s for s in (joined_stall(gaps[hop], w) for w in windows) if s is not None]
        row["joined_stall_median"] = statistics.median(stalls) if stalls else None
        row["joined_stall_max"] = max(stalls) if stalls else None
        out[hop] = row
    return out


def node_hops(decode: Mapping[str, Mapping[str, Sequence[float]]],
              router: Mapping[str, Mapping[str, Sequence[float]]],
              client: Mapping[str, Sequence[float]], requests: Iterable[str]
              ) -> dict[str, dict[str, list[float]]]:
    """The hops of `requests` from the decode node's and the router's `/internal/token_times`
    bodies (each `{"applied": {rid: [...]}, "read": {...}}`) and the client's arrivals by request.
    The first token of a request is its prefill's: a decode node and a router apply it as no
    decode step, so every hop drops it and starts at the second token (the client's and the
    writers' first gap would be the prefill's wait, not a step's)."""
    wanted = set(requests)
    points = {"decode applied": decode.get("applied", {}), "decode read": decode.get("read", {}),
              "router applied": router.get("applied", {}), "router read": router.get("read", {})}
    out: dict[str, dict[str, list[float]]] = {}
    for hop, times in points.items():
        skip = 0 if hop.endswith("applied") else 1
        out[hop] = {rid: list(t[skip:]) for rid, t in times.items() if rid in wanted}
    out["client"] = {rid: list(t[1:]) for rid, t in client.items() if rid in wanted}
    return out


def within(hops: Mapping[str, Mapping[str, Sequence[float]]], spans: Sequence[Window]
           ) -> dict[str, dict[str, list[float]]]:
    """The hops' moments that lie in one of `spans` (time stretches, e.g. the rounds run at one
    setting): a gap then joins two tokens of one stretch, never two stretches."""
    out: dict[str, dict[str, list[float]]] = {}
    for hop, times in hops.items():
        kept: dict[str, list[float]] = {}
        for rid, moments in times.items():
            for i, (start, end) in enumerate(spans):
                inside = [t for t in moments if start <= t <= end]
                if inside:
                    kept[f"{rid}@{i}"] = inside
        out[hop] = kept
    return out


def table(rows: Mapping[str, Mapping[str, float | int | None]]) -> str:
    """The figures as a markdown table, one row per hop."""

    def cell(value: float | int | None, fmt: str = ".2f") -> str:
        return "-" if value is None else format(value, fmt)

    split = any("p99_busy" in r for r in rows.values())
    lines = ["| hop | gaps in / out | p99 in | max in | p99 out | max out "
             + ("| out, a prefill on the clients' core: p99 / max | out, none: p99 / max " if split else "")
             + "| joined stall median / max |",
             "|---|---|---|---|---|---|" + ("---|---|" if split else "") + "---|"]
    for hop, r in rows.items():
        lines.append(f"| {hop} | {r['n_in']} / {r['n_out']} | {cell(r['p99_in'])} | {cell(r['max_in'])} "
                     f"| {cell(r['p99_out'])} | {cell(r['max_out'])} "
                     + (f"| {cell(r.get('p99_busy'))} / {cell(r.get('max_busy'))} "
                        f"| {cell(r.get('p99_idle'))} / {cell(r.get('max_idle'))} " if split else "")
                     + f"| {cell(r['joined_stall_median'])} / {cell(r['joined_stall_max'])} |")
    step = next(iter(rows.values()))["step_ms"] if rows else None
    lines.append(f"(in the decode engine's median step outside the windows: {cell(step, '.1f')} ms)")
    return "\n".join(lines)
