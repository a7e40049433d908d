"""One stream, request by request: statecore single nodes (with a draft model, with prompt lookup,
without speculation) against mlx_lm.server with the same draft model and target, greedy, at
concurrency 1, on a chat workload and a code-editing one.

Starts mlx_lm.server and a single node per `--variants` entry (and, with `--base-src`, the same
variants of a second source tree: a before), all in the same environment (so the same BLAS).
Each round is one fresh prompt of `--prompt-tokens` tokens (so mlx_lm.server's prompt cache never
hits) per workload, sent to every server in turn as a streamed completion of `--max-tokens`
tokens (`ignore_eos`), the order rotating from round to round; requests never overlap, so the
servers share the machine alike and a busy box weighs on neighbours of a round alike. `chat`: the
prompt does not hold the answer. `edit` (a chain model's, as the default and the GPU's targets
are): the chat prompt's tokens, the chain after its last token, then the chat prompt's tokens
again, so the prompt holds the answer as a code edit's holds most of the new file; the single
nodes take it as token ids, mlx_lm.server (text only) as their text, which it encodes anew (a
random model's text does not encode back to its tokens: its answer may then differ).
Per request the client stamps the response headers, the first body byte, the first and second
texts and the end, and reads the server's CPU (its process tree's, /proc) before and after; per
server and workload it reports the medians of tokens/s (max_tokens over the request's whole time),
time to first text, the gap from the first text to the second, the time per token after the first,
the CPU a token took (every thread's, the BLAS workers' too: what a request costs, which a busy
box stretches less than its wall time), and each round's ratios (their median is the figure: a
ratio of neighbours, not of two medians) to mlx_lm.server, to the same tree without speculation,
and to the base tree's same variant. It also says whether every server returned the same text, and the load
average beside every round.

    .venv/bin/python bench/serving/one_stream.py --rounds 4     # the chain model and its draft
    git archive main src | tar -x -C /tmp/base && .venv/bin/python bench/serving/one_stream.py \\
        --base-src /tmp/base/src                                     # ... and main's nodes beside
    .venv/bin/python bench/serving/one_stream.py --model TARGET --draft-model DRAFT --variants draft

With no `--model` the target is a chain model (`support.chain_model`: a random llama, hidden 2048 x
2 layers, float32, whose next token mostly follows a fixed chain) and the draft model one of
hidden 256 x 1 layer built the same way, so drafts often stand; both are built once under
~/.cache/statecore/one_stream. `--no-draft`: mlx_lm.server and the `draft` variant decode without
a draft model.

Bench code: it may import anything, and nothing under src/ may import it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: benchlib

from benchlib import (
    ROOT,
    PromptMaker,
    Server,
    load_tokenizer,
    machine,
    server_env,
)
from side_by_side import cpu_seconds

from adapters.blas import blas_of_process_tree
from adapters.serve.listeners import free_port


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


VARIANTS = {"draft": [], "ngram": ["--speculative", "ngram"], "off": []}  # a draft model's flags come apart
WORKLOADS = ("chat", "edit")


def one_request(client: httpx.Client, url: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion, stamped from the moment it is sent: headers, first body byte,
    first and second text, end (seconds); its text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    client.get(f"{url}/v1/models")  # a stale keep-alive connection fails here, not in the timed request
    texts: list[str] = []
    first_byte = first_text = second_text = None
    sent = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        headers = time.perf_counter() - sent
        response.raise_for_status()
        pending = b""
        for chunk in response.iter_raw():
            if first_byte is None:
                first_byte = time.perf_counter() - sent
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.startswith(b"data: {"):
                    continue
                doc = json.loads(line[6:])
                text = "".join(choice.get("text") or "" for choice in doc.get("choices") or [])
                if text:
                    if first_text is None:
                        first_text = time.perf_counter() - sent
                    elif second_text is None:
                        second_text = time.perf_counter() - sent
                    texts.append(text)
    end = time.perf_counter() - sent
    if first_text is None:
        raise SystemExit(f"{url}: a stream with no text")
    return {"headers_s": headers, "first_byte_s": first_byte, "ttft_s": first_text,
            "second_gap_s": (second_text or end) - first_text, "end_s": end,
            "tok_s": max_tokens / end, "tpot_s": (end - first_text) / max(1, max_tokens - 1),
            "text": "".join(texts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="target model dir (default: the chain model)")
    parser.add_argument("--draft-model", type=Path, default=None,
                        help="mlx_lm.server and the draft variant draft with it (default: the chain draft "
                             "model with no --model)")
    parser.add_argument("--no-draft", action="store_true", help="no server decodes with a draft model")
    parser.add_argument("--num-draft-tokens", type=int, default=3)
    parser.add_argument("--variants", default="draft",
                        help=f"the single nodes' ways to decode, comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--workloads", default="chat", help=f"comma-separated, of {','.join(WORKLOADS)}")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--base-src", type=Path, default=None,
                        help="also single nodes running this src/ tree (e.g. main's, for a before)")
    parser.add_argument("--env-variant", action="append", default=[], metavar="LABEL:NAME=VALUE,...",
                        help="also this tree's nodes with these environment settings on top, named "
                             "LABEL-<variant> (repeatable), e.g. t1:OPENBLAS_NUM_THREADS=1")
    parser.add_argument("--blas", choices=["auto", "openblas", "bundled"], default="auto")
    parser.add_argument("--statecore-arg", action="append", default=[],
                        help="an extra flag for the single nodes")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "one_stream")
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    model, draft_model = args.model, args.draft_model
    if model is None:
        model, chain_draft = chain_models()
        draft_model = draft_model or chain_draft
    if args.no_draft:
        draft_model = None
    variants = [v for v in args.variants.split(",") if v]
    workloads = [w for w in args.workloads.split(",") if w]
    if unknown := [v for v in variants if v not in VARIANTS] + [w for w in workloads if w not in WORKLOADS]:
        parser.error(f"unknown variants or workloads: {unknown}")
    args.out.mkdir(parents=True, exist_ok=True)
    drafting = [] if draft_model is None else [
        "--draft-model", str(draft_model), "--num-draft-tokens", str(args.num_draft_tokens)]
    py = sys.executable
    trees: list[tuple[str, Path, dict[str, str]]] = [("sc", ROOT / "src", {})]
    if args.base_src is not None:
        trees.append(("base", args.base_src.resolve(), {}))
    for text in args.env_variant:
        label, _, settings = text.partition(":")
        pairs = [setting.partition("=") for setting in settings.split(",") if setting]
        if not label.isidentifier() or label in ("sc", "base", "mlx_lm") or not pairs or not all(
                name and sep for name, sep, _ in pairs):
            parser.error(f"--env-variant takes LABEL:NAME=VALUE[,NAME=VALUE...], not {text!r}")
        trees.append((label, ROOT / "src", {name: value for name, _, value in pairs}))
    wanted: list[tuple[str, Path | None, list[str]]] = [("mlx_lm", None, drafting)]
    wanted += [(f"{tree}-{variant}", src, [*(drafting if variant == "draft" else VARIANTS[variant])])
               for tree, src, _ in trees for variant in variants]
    tree_env = {f"{tree}-{variant}": env for tree, _, env in trees for variant in variants}
    servers: list[Server] = []
    for name, src, flags in wanted:
        port = free_port()
        if src is None:
            argv_ = [py, "-m", "mlx_lm", "server", "--model", str(model), "--host", "127.0.0.1",
                     "--port", str(port), "--log-level", "WARNING", *flags]
        else:
            argv_ = [py, "-m", "adapters.cli", "run", "--role", "single", "--model", str(model),
                     "--port", str(port), "--log-level", "WARNING", *flags, *args.statecore_arg]
        servers.append(Server(name, argv_, port, args.out / f"{name}.log"))
    meta: dict[str, Any] = {"machine": machine(), "model": str(model), "draft_model": str(draft_model),
                            "num_draft_tokens": args.num_draft_tokens, "prompt_tokens": args.prompt_tokens,
                            "max_tokens": args.max_tokens, "rounds": args.rounds, "variants": variants,
                            "workloads": workloads, "base_src": str(args.base_src),
                            "statecore_args": args.statecore_arg, "env_variants": args.env_variant,
                            "round_loads": []}
    # a `timeout` (SIGTERM) ends the run through the `finally` below: the servers stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for server, (_, src, _) in zip(servers, wanted, strict=True):
            env, blas = server_env(args.blas, "mlx_lm" if src is None else "single")
            if src is not None:
                env["PYTHONPATH"] = os.pathsep.join([str(src), *env["PYTHONPATH"].split(os.pathsep)[1:]])
                env.update(tree_env[server.name])
            meta["blas"] = blas
            server.start(env)
        for server in servers:
            server.wait_ready(args.startup_timeout)
        meta["blas_used"] = {s.name: blas_of_process_tree(s.proc.pid) for s in servers if s.proc}
        maker = PromptMaker(load_tokenizer(model))
        rng = random.Random(time.time_ns())
        results: dict[str, dict[str, list[dict[str, Any]]]] = {
            w: {s.name: [] for s in servers} for w in workloads}
        meta["load_before"] = load_average()
        with httpx.Client(timeout=600) as client:
            for server in servers:  # warm: the first request of a process pays for lazy setup
                for _ in range(2):
                    one_request(client, server.url, maker.make(args.prompt_tokens, rng), 8)
            for round_ in range(args.rounds):
                chat = maker.make(args.prompt_tokens, rng)
                shift = round_ % len(servers)
                for workload in workloads:
                    ids = None if workload == "chat" else edit_prompt(maker.tokenizer.encode(chat),
                                                                      args.max_tokens)
                    for server in servers[shift:] + servers[:shift]:
                        prompt: str | list[int] = chat
                        if ids is not None:
                            prompt = maker.tokenizer.decode(ids) if server.name == "mlx_lm" else ids
                        cpu_before = cpu_seconds(server)
                        result = one_request(client, server.url, prompt, args.max_tokens)
                        result["cpu_s"] = cpu_seconds(server) - cpu_before
                        result["round"] = round_
                        results[workload][server.name].append(result)
                    load = load_average()
                    meta["round_loads"].append({"round": round_, "workload": workload, "load": load})
                    print(f"round {round_ + 1}/{args.rounds} {workload} (load {load}): " + ", ".join(
                        f"{name} {runs[-1]['tok_s']:.2f}" for name, runs in results[workload].items()),
                        flush=True)
        meta["load_after"] = load_average()
    finally:
        for server in servers:
            server.stop()
    summary = {workload: summarize(results[workload], args.max_tokens) for workload in workloads}
    print(f"\n{args.rounds} rounds of {args.prompt_tokens}x{args.max_tokens}, greedy, "
          f"{'draft model ' + str(draft_model) if draft_model else 'no draft model'}; "
          f"load {meta['load_before']} -> {meta['load_after']}")
    for workload in workloads:
        print(f"-- {workload}")
        for name, row in summary[workload]["servers"].items():
            print(f"  {name:10s} tok/s p50 {row['tok_s_p50']:7.2f} (mean {row['tok_s_mean']:.2f})  TTFT p50 "
                  f"{row['ttft_ms_p50']:7.1f} ms  1st->2nd p50 {row['second_gap_ms_p50']:6.1f} ms  TPOT p50 "
                  f"{row['tpot_ms_p50']:6.2f} ms  first byte {row['first_byte_ms_p50']:6.1f} ms  CPU a token "
                  f"{row['cpu_ms_per_token_p50']:6.2f} ms")
        for name, row in summary[workload]["ratios"].items():
            print(f"  {name:22s} per round: tok/s p50 {row['tok_s_p50']:.3f} (min {row['tok_s_min']:.3f}, "
                  f"{row['rounds_at_least_1']}/{args.rounds} >= 1), TTFT p50 {row['ttft_p50']:.3f}, "
                  f"1st->2nd p50 {row['second_gap_p50']:.3f}, CPU a token p50 {row['cpu_p50']:.3f}")
        print(f"  same text on every server: {summary[workload]['same_text']} (statecore's nodes: "
              f"{summary[workload]['same_text_nodes']})")
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "requests": results},
                                                      indent=2, default=str))
    print(f"results: {args.out / 'results.json'}")
    return 0


def chain_models() -> tuple[Path, Path]:
    """The chain model (hidden 2048 x 2 layers) and its draft model (256 x 1), built once."""
    from support.chain_model import build_chain_checkpoint

    home = Path.home() / ".cache" / "statecore" / "one_stream"
    built = []
    for name, hidden, layers in (("target-2048x2", 2048, 2), ("draft-256x1", 256, 1)):
        path = home / name
        if not (path / "config.json").exists():
            build_chain_checkpoint(path, hidden_size=hidden, num_layers=layers)
        built.append(path)
    return built[0], built[1]


def edit_prompt(chat: list[int], max_tokens: int) -> list[int]:
    """A prompt that holds its answer, for a chain model: the chat prompt's tokens, the chain after
    its last token (what the model mostly writes there), then the chat prompt's tokens again."""
    from support.chain_model import chain

    return [*chat, *chain(chat[-1], max_tokens + 32)[1:], *chat]


def pairs_of(names: list[str]) -> list[tuple[str, str]]:
    """The ratios reported: each node against mlx_lm.server, a tree's speculation against its own
    decoding without it, and this tree's variants against the base tree's and against this tree's
    with another environment (`--env-variant`)."""
    pairs = [(name, "mlx_lm") for name in names if name != "mlx_lm"]
    for name in names:
        tree, _, variant = name.partition("-")
        if variant in ("draft", "ngram") and f"{tree}-off" in names:
            pairs.append((name, f"{tree}-off"))
        if tree == "sc" and f"base-{variant}" in names:
            pairs.append((name, f"base-{variant}"))
        if tree not in ("sc", "base", "mlx_lm") and f"sc-{variant}" in names:
            pairs.append((name, f"sc-{variant}"))
    return pairs


def summarize(results: dict[str, list[dict[str, Any]]], max_tokens: int) -> dict[str, Any]:
    def p50(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> float:
        return float(statistics.median(run[key] for run in runs)) * scale

    servers = {name: {"tok_s_p50": p50(runs, "tok_s"),
                      "tok_s_mean": statistics.mean(run["tok_s"] for run in runs),
                      "ttft_ms_p50": p50(runs, "ttft_s", 1000), "tpot_ms_p50": p50(runs, "tpot_s", 1000),
                      "second_gap_ms_p50": p50(runs, "second_gap_s", 1000),
                      "headers_ms_p50": p50(runs, "headers_s", 1000),
                      "first_byte_ms_p50": p50(runs, "first_byte_s", 1000),
                      "cpu_ms_per_token_p50": p50(runs, "cpu_s", 1000) / max_tokens}
               for name, runs in results.items()}
    ratios = {}
    for name, other in pairs_of(list(results)):
        ours, theirs = results[name], results[other]
        tok = [a["tok_s"] / b["tok_s"] for a, b in zip(ours, theirs, strict=True)]
        ttft = [a["ttft_s"] / b["ttft_s"] for a, b in zip(ours, theirs, strict=True)]
        gap = [a["second_gap_s"] / b["second_gap_s"] for a, b in zip(ours, theirs, strict=True)]
        cpu = [a["cpu_s"] / b["cpu_s"] for a, b in zip(ours, theirs, strict=True)]
        ratios[f"{name} / {other}"] = {
            "tok_s_p50": statistics.median(tok), "tok_s_mean": statistics.mean(tok), "tok_s_min": min(tok),
            "tok_s_each": tok, "rounds_at_least_1": sum(r >= 1 for r in tok),
            "ttft_p50": statistics.median(ttft), "second_gap_p50": statistics.median(gap),
            "cpu_p50": statistics.median(cpu)}
    texts = [[run["text"] for run in runs] for runs in results.values()]
    nodes = [[run["text"] for run in runs] for name, runs in results.items() if name != "mlx_lm"]
    return {"servers": servers, "ratios": ratios, "same_text": all(t == texts[0] for t in texts),
            "same_text_nodes": all(t == nodes[0] for t in nodes)}


if __name__ == "__main__":
    raise SystemExit(main())
