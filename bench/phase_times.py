"""Where a request's time went, from the nodes' transition logs (`--log-level INFO --log-transitions`).

    .venv/bin/python bench/phase_times.py LOG [LOG ...] [--last N]

Every node logs `request <id> <from> -> <to> on <event>` with a millisecond timestamp; this
groups the lines of all the given logs (a cluster's processes share one log under
`statecore run`) by request and prints, for the last N requests, each transition's time since
that request's first line, with the role that logged it, then the median of each (role, from ->
to) step over every request. Clocks are one machine's, so the roles' lines compare. Bench code:
nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^(\S+ \S+) (\w+)\s+INFO request (\S+) (\w+) -> (\w+) on (\w+)")


def parse(paths: list[Path]) -> dict[str, list[tuple[float, str, str]]]:
    """request id -> [(seconds, role, "from -> to"), ...] in time order."""
    by_request: dict[str, list[tuple[float, str, str]]] = defaultdict(list)
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            match = LINE.match(line)
            if match is None:
                continue
            stamp, role, rid, old, new, _ = match.groups()
            at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            by_request[rid.split(".retry")[0]].append((at, role, f"{old} -> {new}"))
    for lines in by_request.values():
        lines.sort()
    return by_request


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", type=Path, nargs="+")
    parser.add_argument("--last", type=int, default=2, help="requests printed whole (default 2)")
    args = parser.parse_args()
    by_request = parse(args.logs)
    if not by_request:
        print("no transition lines (run the nodes with --log-level INFO --log-transitions)")
        return 1
    ordered = sorted(by_request.items(), key=lambda item: item[1][0][0])
    for rid, lines in ordered[max(0, len(ordered) - args.last):]:
        start = lines[0][0]
        print(f"request {rid}:")
        for at, role, step in lines:
            print(f"  {1000 * (at - start):8.1f} ms  {role:7s} {step}")
    steps: dict[tuple[str, str], list[float]] = defaultdict(list)
    for lines in by_request.values():
        start = lines[0][0]
        for at, role, step in lines:
            steps[(role, step)].append(1000 * (at - start))
    print(f"median ms since the request's first line, over {len(by_request)} requests:")
    for (role, step), times in sorted(steps.items(), key=lambda item: statistics.median(item[1])):
        print(f"  {statistics.median(times):8.1f}  {role:7s} {step}  (n={len(times)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
