"""Where a handoff's overhead goes, hop by hop, from a step trace (`bench/step_trace/sitecustomize.py`)
of `bench/handoff/handoff_overhead.py`: for each prompt whose first token a prefill node computed, the
milliseconds from that moment (its `tell_first_tokens`) to each later hop of the handoff on either
node, matched by time (the bench sends one prompt at a time), then the medians by kind (streamed:
pieces handed out with the first token; pulled: none).

    STEP_TRACE=/tmp/steps PYTHONPATH=bench/step_trace:$PYTHONPATH \
        python3 bench/handoff/handoff_overhead.py --transitions ...
    python3 bench/step_trace/hops.py /tmp/steps

Columns (ms after the first token was read back on the prefill node; "-" where the trace has none or
the node does not make that hop): the first token written to the stream (the prefill node's front
end); the last piece handed out by the prefill's device thread; then, after it, that piece put into
the prefill core's shared memory (an engine core process's) and its record written to the stream by
the prefill node's front end; on the decode node, the last piece handed to its engine (front end),
reaching the engine core process, taken or staged; the install asked by the front end; a pull's
export asked and done on the prefill node, and its payload checked and built on the decode node;
the join; and the decode's first step after it.

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from timeline import read

WINDOW_S = 0.5  # a handoff's hops all come this soon after its first token (one prompt at a time)
JOINS = ("Joining.join", "Performer.join")  # the join's name now, and before adapters.mlx.joining
STAGES = ("Joining.stage", "Performer.stage", "device_pieces.take", "StagedSlots.stage")
PREFILL, DECODE = ("prefill", "prefill-core"), ("decode", "decode-core")
EXPORTS = ("MlxEngine.export_held", "ProcessEngine.export_held")
# (column, names, roles, which: the first after the last piece was handed out, or the last before the
# join; its start or end)
HOPS: tuple[tuple[str, tuple[str, ...], tuple[str, ...], str, str], ...] = (
    ("first token out", ("stream.document_record",), ("prefill",), "first", "start"),
    ("last piece handed", ("PieceHandout.__call__",), PREFILL, "last", "end"),
    ("into shm", ("ShmOutbox.put",), ("prefill-core",), "first", "start"),
    ("record written", ("stream.shared_segment_record",), ("prefill",), "first", "start"),
    ("decode has it", ("ProcessEngine.receive_segment", "MlxEngine.receive_segment"), ("decode",), "last",
     "start"),
    ("decode core has it", ("MlxEngine.receive_segment",), ("decode-core",), "last", "start"),
    ("staged", STAGES, DECODE, "last", "end"),
    ("install asked", ("ProcessEngine.install_segments", "MlxEngine.install_segments",
                       "ProcessEngine.install", "MlxEngine.install"), ("decode",), "last", "start"),
    # a pull: the prefill node's export (its device thread copies the cache out), the payload
    # checked and built on the decode node (inside its install)
    ("export asked", EXPORTS, ("prefill",), "first", "start"),
    ("exported", EXPORTS, ("prefill",), "first", "end"),
    ("built", ("ArrivingKv.built_payload",), DECODE, "last", "end"),
)
COLUMNS = (*(hop[0] for hop in HOPS), "joined", "first step")

Call = tuple[str, float, float, str, str]  # name, start s, ms, thread, role


def hops(calls: list[Call], told_at: float, window_s: float = WINDOW_S) -> tuple[bool, list[float | None]]:
    """One handoff's hops after `told_at` (seconds), and whether its pieces were streamed."""
    window = [call for call in calls if told_at <= call[1] <= told_at + window_s]
    joined = next((call[1] for call in window if call[0] in JOINS and call[4] in DECODE), None)
    if joined is None:
        return False, [None] * len(COLUMNS)
    window = [call for call in window if call[1] <= joined]
    handed = [call for call in window if call[0] == "PieceHandout.__call__" and call[4] in PREFILL]
    handed_at = handed[-1][1] if handed else told_at
    moments: list[float | None] = []
    for _, names, roles, which, edge in HOPS:
        found = [call for call in window if call[0] in names and call[4] in roles
                 and (which == "last" or call[1] >= handed_at)]
        if not found:
            moments.append(None)
            continue
        _, start, ms, _, _ = found[-1] if which == "last" else found[0]
        moments.append(start + (ms / 1000 if edge == "end" else 0.0))
    first_step = next((call[1] for call in calls if call[0] == "StepExecutor.step" and call[4] in DECODE
                       and call[1] >= joined), None)
    moments += [joined, first_step]
    return bool(handed), [None if at is None else (at - told_at) * 1000 for at in moments]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--rows", action="store_true", help="every handoff's row, not only the medians")
    parser.add_argument("--window-ms", type=float, default=WINDOW_S * 1000,
                        help="how long after its first token a handoff's hops may come (a loaded box: more)")
    args = parser.parse_args()
    processes = read(args.directory)
    calls: list[Call] = sorted(((name, start, ms, thread, role) for role, found in processes.values()
                                for name, start, ms, thread in found), key=lambda call: call[1])
    told = [call[1] for call in calls if call[0] == "kv_out.tell_first_tokens" and call[4] in PREFILL]
    rows: dict[bool, list[list[float | None]]] = {True: [], False: []}
    print("| handoff | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    # every read-back tells its step's finished prompts (maybe none): a prompt's handoff is the
    # last telling before its join, not the earlier steps of a long prompt
    last_before: dict[float, tuple[float, bool, list[float | None]]] = {}
    for told_at in told:
        streamed, row = hops(calls, told_at, args.window_ms / 1000)
        joined = row[-2]
        if joined is None:
            continue  # no join followed: a warm-up's or a request that ended at its first token
        last_before[round(told_at + joined / 1000, 6)] = (told_at, streamed, row)
    for told_at, streamed, row in sorted(last_before.values()):
        rows[streamed].append(row)
        if args.rows:
            print(f"| {'stream' if streamed else 'pull'} {told_at:.3f} | "
                  + " | ".join("-" if at is None else f"{at:.1f}" for at in row) + " |")
    for streamed, found in rows.items():
        if not found:
            continue
        medians = []
        for column in range(len(COLUMNS)):
            values = [row[column] for row in found if row[column] is not None]
            medians.append(f"{statistics.median(values):.1f}" if values else "-")
        kind = "streamed" if streamed else "pulled"
        print(f"| median, {kind} ({len(found)}) | " + " | ".join(medians) + " |")


if __name__ == "__main__":
    main()
