"""Per process of a GC_LOG directory (`bench/gc_pauses/sitecustomize.py`): its role, how many full
collections it made, and the longest ones (thread CPU and wall ms, objects walked), optionally only
those after `--after` (a wall-clock time, e.g. when serving began).

    GC_LOG=/tmp/gc PYTHONPATH=bench/gc_pauses .venv/bin/python bench/handoff/handoff_overhead.py ...
    .venv/bin/python bench/gc_pauses/summary.py /tmp/gc

Bench code: nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROLE = re.compile(r"--role (\w+)|(side_by_side|handoff_overhead|mlx_lm\.server|core_process)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--after", type=float, default=0.0, help="wall-clock seconds: only passes after it")
    args = parser.parse_args()
    for path in sorted(args.directory.glob("*.gc")):
        lines = path.read_text().splitlines()
        found = ROLE.search(lines[0]) if lines else None
        role = next((group for group in found.groups() if group), "?") if found else "?"
        full = []
        for line in lines[1:]:
            stamp, generation, wall, cpu, walked, *_ = line.split()
            if generation == "gen2" and float(stamp) >= args.after:
                full.append((float(cpu[4:-2]), float(wall[:-2]), int(walked.split("=")[1])))
        longest = sorted(full, reverse=True)[:4]
        shown = ", ".join(f"{cpu:.1f} cpu / {wall:.1f} wall ms ({walked} objects)"
                          for cpu, wall, walked in longest)
        print(f"{path.stem} {role}: {len(full)} full collections; longest: {shown or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
