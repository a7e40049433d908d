"""Where a burst of first turns' time went (issue 31), from `bench/serving/shared_prefix.py --timeline`'s
results and a step trace of the same run (`bench/step_trace/sitecustomize.py`): for each server and
round, the first tokens' moments after the first request was sent (first, p50, last), when the
prompts were tokenized (the front end's chat template) and reached the device thread, then each
device step in the window: its start and length, the time its prefill calls took to build
(`PrefillBuild.build`), to launch (`mx.async_eval`) and to read back, and its prefill calls
(`run_units`, a call or a unit each) and cached starts (`PrefixCache.start`), and how many first
tokens the client saw during it. Clocks: the trace's and the client's monotonic (one host).

    STEP_TRACE=/tmp/steps PYTHONPATH=bench/step_trace:$PYTHONPATH python3 bench/serving/shared_prefix.py \\
        --scenarios system --timeline ... --out /tmp/sp
    python3 bench/step_trace/first_turns.py /tmp/sp/results.json /tmp/steps [--rounds 0,1]

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from timeline import read

Call = tuple[str, float, float, str]


def by_port(directory: Path) -> dict[int, list[Call]]:
    """Every traced call of a server (its node and its engine core process, if any), by its port."""
    ports: dict[str, int] = {}
    for log in directory.glob("*.log"):
        for line in log.read_text().splitlines()[:2]:
            if line.startswith("# argv ") and (found := re.search(r"--port[ =](\d+)", line)):
                ports[log.stem] = int(found.group(1))
    parents = {log.stem: line[7:].strip() for log in directory.glob("*.log")
               for line in log.read_text().splitlines()[:1] if line.startswith("# ppid ")}
    calls: dict[int, list[Call]] = {}
    for pid, (_, mine) in read(directory).items():
        port = ports.get(pid, ports.get(parents.get(pid, ""), 0))
        if port:
            calls.setdefault(port, []).extend(mine)
    return calls


def report(name: str, round_: int, record: dict[str, object], calls: list[Call]) -> None:
    requests = [r for r in record["requests"] if isinstance(r, dict) and r.get("ttft_s") is not None]  # type: ignore[union-attr]
    if not requests:
        print(f"{name} round {round_}: no timeline (run shared_prefix.py with --timeline)")
        return
    t0 = min(r["sent_mono"] for r in requests)
    firsts = sorted(r["sent_mono"] + r["ttft_s"] - t0 for r in requests)
    end = firsts[-1]
    window = sorted((start - t0, took, what) for what, start, took, _ in calls
                    if -0.01 <= start - t0 <= end + 0.01)

    def ms(at: float) -> str:
        return f"{at * 1000:.0f}"

    print(f"{name} round {round_}: first tokens at {ms(firsts[0])} / p50 {ms(statistics.median(firsts))} / "
          f"last {ms(end)} ms after the first send ({len(firsts)} requests)")
    encoded = [(at, took) for at, took, what in window if what == "Prompts.encode_chat"]
    if encoded:
        done = max(at * 1000 + took for at, took in encoded)
        print(f"  tokenized (chat template): the last done at {done:.0f} ms")
    arrived = [at for at, _, what in window if what == "Performer.register"]
    if arrived:
        print(f"  on the device thread: {ms(arrived[0])} .. {ms(arrived[-1])} ms ({len(arrived)} prompts)")
    for at, took, what in window:
        if what != "StepExecutor.step":
            continue
        inside = [(a, t, w) for a, t, w in window if at <= a <= at + took / 1000 and w != what]
        total = {kind: sum(t for _, t, w in inside if w == kind)
                 for kind in ("PrefillBuild.build", "core.async_eval", "StepExecutor.read_back")}

        units = sum(1 for _, _, w in inside if w == "prefill.run_units")
        starts = sum(1 for _, _, w in inside if w == "PrefixCache.start")
        seen = sum(1 for f in firsts if at <= f < at + took / 1000)
        print(f"  step at {at * 1000:7.1f} ms, {took:6.1f} ms: build {total['PrefillBuild.build']:6.1f}, "
              f"launch {total['core.async_eval']:6.1f}, read back {total['StepExecutor.read_back']:5.1f} ms; "
              f"{units} prompt-unit builds, {starts} cached starts; {seen} first tokens seen meanwhile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--rounds", default=None, help="which rounds (default: all)")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    traced = by_port(args.directory)
    wanted = None if args.rounds is None else {int(r) for r in args.rounds.split(",")}
    for name, records in results.get("system", {}).items():
        calls = traced.get(results.get("ports", {}).get(name, -1), [])
        for round_, record in enumerate(records):
            if wanted is None or round_ in wanted:
                report(name, round_, record, calls)


if __name__ == "__main__":
    main()
