"""Profile a statecore single node under load with py-spy (sampling; every thread; no code changes).

Starts `statecore run --role single` (same environment as bench/serving/side_by_side.py, so the same BLAS
choice), warms it, then runs py-spy against its pid for --duration seconds while
bench/clients/serve_bench.py's load generator keeps --concurrency streaming requests in flight. Writes
py-spy's raw collapsed stacks (profile.txt, flamegraph.pl's input), and prints the top
functions by own ("self") samples and by inclusive samples, per thread, to stdout and top.txt.
Then the CPU each of the node's threads used over the whole load (/proc/<pid>/task: the trio event
loop is the main thread), per output token.

    .venv/bin/python bench/serving/profile_single.py --model DIR --concurrency 32 --duration 20

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    ROOT,
    Mix,
    PromptMaker,
    build_prompts,
    default_model,
    load_tokenizer,
    make_servers,
    parse_mix,
    run_load,
    server_env,
    summarize,
)


def _device_wait_frame() -> str:
    """`file:line` where the engine's device thread blocks for jobs when nothing decodes."""
    src = ROOT / "src" / "adapters" / "mlx" / "device.py"
    for number, line in enumerate(src.read_text().splitlines(), 1):
        if "self.queue.get()" in line:
            return f"device.py:{number})"
    return "device.py:?)"


# Leaf frames that mean "this thread is waiting": trio's epoll wait, an idle trio worker thread,
# the device thread blocked on its job queue.
IDLE_LEAVES = ("_io_epoll.py:243)", "_thread_cache.py:211)")


def _role(frames: list[str]) -> str:
    text = ";".join(frames)
    if "_thread_main" in text:
        return "device thread (MLX)"
    if "_thread_cache.py" in text:
        return "trio worker threads"
    if "trio/_core/_run.py" in text:
        return "trio event loop (HTTP, SSE, state machines)"
    return "other"


def top_functions(raw: Path, wall_samples: int, limit: int = 12) -> str:
    """Per thread role: share of wall time busy, and the busy frames (self and inclusive).

    `raw` is py-spy's raw output recorded with --idle --threads; `wall_samples` the samples one
    thread gets over the whole recording (duration x rate).
    """
    idle_leaves = (*IDLE_LEAVES, _device_wait_frame())
    roles: dict[str, dict[str, collections.Counter[str]]] = {}
    threads: dict[str, set[str]] = collections.defaultdict(set)
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread (")), "?")
        frames = [f for f in frames if not f.startswith(("thread (", "process "))]
        role = _role(frames)
        threads[role].add(thread)
        c = roles.setdefault(role, {"self": collections.Counter(), "incl": collections.Counter(),
                                    "state": collections.Counter()})
        idle = not frames or frames[-1].endswith(idle_leaves)
        c["state"]["idle" if idle else "busy"] += count
        if idle:
            continue
        c["self"][frames[-1]] += count
        for frame in set(frames):
            c["incl"][frame] += count
    out = [f"wall samples per thread: {wall_samples}"]
    for role, c in sorted(roles.items(), key=lambda kv: -kv[1]["state"]["busy"]):
        n = max(1, len(threads[role]))
        busy = c["state"]["busy"]
        out += ["", f"== {role}: {n} thread(s), busy {100 * busy / (wall_samples * n):.0f}% of wall time"
                f" per thread ({busy} busy samples)"]
        if not busy:
            continue
        out += ["  self (top of stack), % of this role's busy samples:"]
        out += [f"    {100 * k / busy:5.1f}%  {name}" for name, k in c["self"].most_common(limit)]
        out += ["  inclusive, % of this role's busy samples:"]
        out += [f"    {100 * k / busy:5.1f}%  {name}" for name, k in c["incl"].most_common(limit + 8)]
    return "\n".join(out)


def device_time(url: str) -> dict[str, tuple[int, float]]:
    """The node's device-thread time by kind so far ({kind: (calls, seconds)}, /internal/stats)."""
    import httpx

    stats = httpx.get(f"{url}/internal/stats", timeout=10).json()
    return {kind: (v["calls"], v["seconds"]) for kind, v in stats.get("device_time", {}).items()}


def device_time_report(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> str:
    """Per kind of device work in the window: calls, total seconds, ms per call; rows per step."""
    grew = {k: (after[k][0] - before.get(k, (0, 0.0))[0], after[k][1] - before.get(k, (0, 0.0))[1])
            for k in after}
    lines = ["device thread in the window (kind: calls, seconds, ms per call):"]
    for kind, (calls, seconds) in grew.items():
        if kind != "decode_rows":
            lines.append(f"  {kind:16s} {calls:7d} {seconds:8.3f} s {1000 * seconds / max(calls, 1):8.3f} ms")
    steps = grew.get("step", (0, 0.0))[0]
    lines.append(f"  decode rows per step {grew.get('decode_rows', (0, 0.0))[0] / max(steps, 1):.1f}")
    return "\n".join(lines)


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """{tid: (thread name, user + system CPU seconds so far)} of a process (/proc)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        found[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return found


def thread_cpu_report(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], pid: int,
                      tokens: int) -> str:
    """CPU per thread over the load (the main thread is trio's event loop), and per output token."""
    used = sorted(((after[t][1] - before.get(t, ("", 0.0))[1], t, after[t][0]) for t in after), reverse=True)
    lines = [f"CPU per thread over the load ({tokens} output tokens): seconds, ms per token"]
    for seconds, tid, name in used:
        if seconds >= 0.05:
            role = "event loop (main thread)" if tid == pid else name
            lines.append(f"  {role:28s} {seconds:8.2f} s {1000 * seconds / max(tokens, 1):7.3f} ms")
    total = sum(seconds for seconds, _, _ in used)
    lines.append(f"  {'all threads':28s} {total:8.2f} s {1000 * total / max(tokens, 1):7.3f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--mix", default=None,
                        help="'realish' or PxO: overrides --prompt-tokens/--output-tokens")
    parser.add_argument("--statecore-arg", action="append", default=[], help="extra flag for the node")
    parser.add_argument("--requests", type=int, default=None,
                        help="at most this many (default 20 x concurrency); stops when py-spy does")
    parser.add_argument("--duration", type=int, default=20)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--gil", action="store_true",
                        help="sample only the thread holding the GIL: 'busy' is then each thread's "
                             "share of wall time holding it")
    parser.add_argument("--native", action="store_true",
                        help="py-spy --native: C/C++ frames too (where MLX's own calls spend their "
                             "time); pauses the node at each sample, so use a low --rate")
    parser.add_argument("--busy-only", action="store_true",
                        help="py-spy without --idle: only samples of threads that are running")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment setting for the node (repeatable), e.g. OPENBLAS_NUM_THREADS=1")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"], default="auto")
    spy_default = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    parser.add_argument("--py-spy", default=spy_default, help="the py-spy executable")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "profile")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # run `finally`
    model = args.model or default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    env, blas = server_env(args.blas)
    env.update(setting.split("=", 1) for setting in args.env)
    maker = PromptMaker(load_tokenizer(model))
    (server,) = make_servers(model, args.out, ["single"], args.statecore_arg)
    server.start(env)
    try:
        server.wait_ready(900)
        asyncio.run(run_load(server.url, build_prompts(maker, Mix("warm", 64, 8), 8, 99), concurrency=8))
        n = args.requests or 20 * args.concurrency
        mix = parse_mix(args.mix) if args.mix else Mix("p", args.prompt_tokens, args.output_tokens)
        prompts = build_prompts(maker, mix, n, 7)
        assert server.proc is not None
        raw = args.out / "profile.txt"
        spy = [args.py_spy, "record", "--pid", str(server.proc.pid), "--duration", str(args.duration),
               "--rate", str(args.rate), "--threads", *([] if args.busy_only else ["--idle"])]
        spy += ["--gil"] if args.gil else []
        # Native frames need the process paused at each sample (it perturbs; keep the rate low).
        spy += ["--native"] if args.native else ["--nonblocking"]
        result: dict[str, object] = {}

        done = threading.Event()

        def load() -> None:
            results, wall = asyncio.run(run_load(server.url, prompts, concurrency=args.concurrency,
                                                 progress="load", stop=done.is_set))
            result.update(summarize(results, wall))

        loader = threading.Thread(target=load)
        cpu_before = thread_cpu(server.proc.pid)
        loader.start()
        time.sleep(3)  # let the batch fill, then sample
        try:
            before = device_time(server.url)
            subprocess.run([*spy, "--format", "raw", "-o", str(raw)], check=True)
            device = device_time_report(before, device_time(server.url))
        finally:
            done.set()  # send nothing more; in-flight requests finish
            loader.join()
        tokens = int(str(result.get("output_tokens") or 0))
        cpu = thread_cpu_report(cpu_before, thread_cpu(server.proc.pid), server.proc.pid, tokens)
        summary = top_functions(raw, args.duration * args.rate) + "\n" + device + "\n" + cpu
        header = (f"model {model} BLAS {blas}; load: {mix.name} at "
                  f"concurrency {args.concurrency}; output {result.get('output_tok_s')} tok/s; "
                  f"py-spy {args.duration} s at {args.rate} Hz{' (GIL holder only)' if args.gil else ''}\n")
        (args.out / "top.txt").write_text(header + summary + "\n")
        print(header + summary)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
