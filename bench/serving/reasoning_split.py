"""Is a reasoning model's split answer the unparsed completion, the same bytes through a cluster,
and what does splitting cost the stream?

For each of `--requests` chats (streamed, seeded, each its own prompt): the single node's
`reasoning_content` and `content` deltas, joined with the think end marker between them when the
model closed its thinking, must equal the text of a streamed `/v1/completions` of the same
prompt ids (`/tokenize`) and sampling; the local cluster's SSE bytes (router, prefill node,
decode node; every prompt handed off) must equal the single node's, `created` aside (both get the
same `X-Request-Id`). The split's cost: each chat stream's tokens/s against its completion's
(the same tokens; both at concurrency 1, one after the other), as a median ratio.

With no `--model`, the tests' tiny llama (hidden 256, 4 layers) with think markers and a template
that opens a think block; its random weights rarely close a think block, so `--end-bias` adds a
logit bias to the end marker's token (0 turns it off; a real reasoning model needs none).

    .venv/bin/python bench/serving/reasoning_split.py --requests 20
    .venv/bin/python bench/serving/reasoning_split.py --model ~/models/Qwen3-0.6B-4bit --end-bias 0

Results: bench/results/reasoning_split-<time>.json. Bench code: it may import anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import BENCH, machine, make_servers, start_all

QUESTIONS = [
    "Why does the river run to the sea?", "What should the farmer plant first?",
    "How many steps does the lighthouse have?", "Which road leads to the market?",
    "What did the letter say?", "When does the train leave?", "Who built the bridge?",
    "Where does the old clock stand?",
]


def stream(client: httpx.Client, url: str, path: str, body: dict[str, Any], request_id: str
           ) -> tuple[list[bytes], float]:
    """The SSE events of one streamed request (raw, `[DONE]` included) and its seconds."""
    started = time.perf_counter()
    events: list[bytes] = []
    with client.stream("POST", url + path, json=body, headers={"X-Request-Id": request_id}) as response:
        response.raise_for_status()
        buffer = b""
        for chunk in response.iter_bytes():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                events.append(event)
    return events, time.perf_counter() - started


def payloads(events: list[bytes]) -> list[Any]:
    return [json.loads(e.removeprefix(b"data: ")) for e in events if e != b"data: [DONE]"]


def without_created(events: list[bytes]) -> list[Any]:
    return [{k: v for k, v in doc.items() if k != "created"} for doc in payloads(events)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a reasoning model's directory (default: the tiny llama)")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--end-bias", type=float, default=10.0, help="logit bias on the think end marker")
    parser.add_argument("--blas", default="auto")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the servers to start")
    args = parser.parse_args()

    from mlx_lm.utils import load_tokenizer

    from support.tiny_models import CORPUS, cached_checkpoint

    model = args.model or cached_checkpoint("llama", hidden_size=256, num_layers=4, thinking=True)
    tokenizer = load_tokenizer(model)
    if not tokenizer.has_thinking:
        raise SystemExit(f"{model}: mlx-lm knows no think markers for this tokenizer")
    end_marker = tokenizer.think_end
    bias = {str(t): args.end_bias for t in tokenizer.think_end_tokens} if args.end_bias else {}

    out = BENCH / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    servers = make_servers(model, out, ["single", "cluster"], [])
    servers[1].argv += ["--force-disaggregation"]
    meta: dict[str, Any] = {"model": str(model), "machine": machine(),
                            "args": vars(args) | {"model": str(model)}}
    rows: list[dict[str, Any]] = []
    try:
        start_all(servers, args.blas, args.timeout, meta)
        single, cluster = (s.url for s in servers)
        with httpx.Client(timeout=600) as client:
            for index in range(args.requests):
                words = " ".join(CORPUS.split()[: 40 + 7 * index])
                messages = [{"role": "user", "content": f"{words}\n{QUESTIONS[index % len(QUESTIONS)]}"}]
                sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": index,
                            **({"logit_bias": bias} if bias else {})}
                chat = {"messages": messages, "stream": True, **sampling}
                request_id = f"split-{stamp}-{index}"
                alone, chat_s = stream(client, single, "/v1/chat/completions", chat, request_id)
                routed, _ = stream(client, cluster, "/v1/chat/completions", chat, request_id)
                prompt = client.post(single + "/tokenize", json={"messages": messages}).json()["tokens"]
                completion = {"prompt": prompt, "stream": True, **sampling}
                raw_events, raw_s = stream(client, single, "/v1/completions", completion, request_id + "-raw")
                deltas = [doc["choices"][0].get("delta", {}) for doc in payloads(alone) if doc["choices"]]
                reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
                content = "".join(d.get("content") or "" for d in deltas)
                raw = "".join(doc["choices"][0]["text"] for doc in payloads(raw_events) if doc["choices"])
                closed = end_marker in raw
                joined = reasoning + end_marker + content if closed else reasoning + content
                rows.append({"index": index, "prompt_tokens": len(prompt), "closed_thinking": closed,
                             "reasoning_chars": len(reasoning), "content_chars": len(content),
                             "equals_unparsed": joined == raw, "cluster_identical":
                                 without_created(alone) == without_created(routed),
                             "chat_s": chat_s, "raw_s": raw_s})
                row = rows[-1]
                print(f"{index:3d} prompt {len(prompt):4d} tok  thought {len(reasoning):4d} ch  answer "
                      f"{len(content):4d} ch  closed {closed!s:5}  = unparsed {row['equals_unparsed']!s:5}  "
                      f"cluster bytes equal {row['cluster_identical']}", flush=True)
    finally:
        for server in reversed(servers):
            server.stop()
    ratios = [row["raw_s"] / row["chat_s"] for row in rows]  # chat tok/s over completion tok/s
    summary = {
        "requests": len(rows),
        "closed_thinking": sum(row["closed_thinking"] for row in rows),
        "equals_unparsed": sum(row["equals_unparsed"] for row in rows),
        "cluster_identical": sum(row["cluster_identical"] for row in rows),
        "chat_over_completion_tok_s_median": statistics.median(ratios) if ratios else None,
    }
    print(json.dumps(summary, indent=1))
    (out / f"reasoning_split-{stamp}.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                                   "rows": rows}, indent=1))
    ok = summary["equals_unparsed"] == summary["cluster_identical"] == len(rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
