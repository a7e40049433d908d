"""One request's timeline across the processes `bench/step_trace/sitecustomize.py` traced: every
traced call that starts within a window, in order, milliseconds from the window's start, with the
process (its command line's role) and thread. The window is the Nth traced `MlxEngine.prefill`
(or `--prefill-of PID`'s) plus `--after-ms`; `--list` prints each process's prefills first.

    STEP_TRACE=/tmp/steps PYTHONPATH=bench/step_trace:$PYTHONPATH \
        python3 bench/handoff/handoff_overhead.py ...
    python3 bench/step_trace/timeline.py /tmp/steps --list
    python3 bench/step_trace/timeline.py /tmp/steps --prefill 7 --after-ms 400 --skip core.eval

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path


def read(directory: Path) -> dict[str, tuple[str, list[tuple[str, float, float, str]]]]:
    """pid -> (what the process was: a node's role, or "<role>-core" for its engine core; its
    calls: name, start s, ms, thread)."""
    found: dict[str, tuple[str, str, list[tuple[str, float, float, str]]]] = {}
    for log in sorted(directory.glob("*.log")):
        what, parent, calls = "?", "", []
        for line in log.read_text().splitlines():
            if line.startswith("# ppid "):
                parent = line[7:].strip()
            elif line.startswith("# argv "):
                role = re.search(r"--role (\w+)", line)
                # an engine core: `python -m adapters.mlx.core_process FD` (its module not yet in argv
                # when the header is written)
                core = "core_process" in line or re.fullmatch(r"-m \d+", line[7:].strip())
                what = role.group(1) if role else ("core" if core else line[7:40])
            else:
                name, start, ms, *thread = line.split()
                calls.append((name, float(start), float(ms), " ".join(thread)[:12]))
        found[log.stem] = (what, parent, calls)
    return {pid: (f"{found[parent][0]}-core" if what == "core" and parent in found else what, calls)
            for pid, (what, parent, calls) in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--list", action="store_true", help="each process's traced prefills, numbered")
    parser.add_argument("--prefill-of", default=None, metavar="PID", help="whose prefills to number "
                        "(default: the process with the most streamed pieces put into shared memory)")
    parser.add_argument("--prefill", type=int, default=-1, help="which of its prefills (default: the last)")
    parser.add_argument("--after-ms", type=float, default=300.0)
    parser.add_argument("--skip", action="append", default=[], help="names left out (repeatable)")
    args = parser.parse_args()
    processes = read(args.directory)
    owner = args.prefill_of or max(processes, key=lambda pid: sum(
        name == "ShmOutbox.put" and thread != "MainThread" for name, _, _, thread in processes[pid][1]))
    prefills = [call for call in processes[owner][1] if call[0] == "MlxEngine.prefill"]
    if args.list or not prefills:
        for pid, (what, calls) in processes.items():
            mine = [call for call in calls if call[0] == "MlxEngine.prefill"]
            print(f"{pid} {what}: {len(calls)} calls; prefills (ms): "
                  + ", ".join(f"{n}: {ms:.0f}" for n, (_, _, ms, _) in enumerate(mine)))
        return
    _, start, _, _ = prefills[args.prefill]
    rows = [(begin, pid, what, name, ms, thread) for pid, (what, calls) in processes.items()
            for name, begin, ms, thread in calls
            if start <= begin <= start + args.after_ms / 1000 and name not in args.skip]
    for begin, pid, what, name, ms, thread in sorted(rows):
        print(f"{(begin - start) * 1000:8.1f} +{ms:7.1f}  {what:>12} {pid:>7} {thread:<12} {name}")


if __name__ == "__main__":
    main()
