"""The flags of `statecore run` (`add_serving_flags`: each under the group of the roles that read
it, `adapters.serve.flag_roles`, its text checked by `adapters.serve.flag_types`) and what they
become once parsed: the model directory, the API keys, the engine core's kind and the TLS files,
each refused with one line before anything loads; the router's local-prefill threshold. Also the
demo model's place (`demo_model_dir`, shipped in `adapters/demo_model`). This module may import
anything; it starts nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
from pathlib import Path

from adapters.http.api_keys import API_KEY_ENV, PROTECTABLE, ApiKeys, keys_from, parse_protects
from adapters.http.peers_httpx import DEFAULT_KV_BUFFER_BYTES
from adapters.model_source import ModelNotFound, resolve_model
from adapters.serve.flag_roles import (
    API,
    ENGINE,
    HANDOFF,
    LIMITS,
    LOGGING,
    MEMORY,
    PARALLEL,
    ROUTER,
    SECURITY,
    SERVE,
    flag_group,
)
from adapters.serve.flag_types import (
    api_key,
    kv_port,
    named_adapter,
    origins,
    protects,
    seconds,
    template_args,
    whole,
)
from adapters.tls import TlsConfigError, tls_files
from effects.faults import DEFAULT_MARKER
from effects.prefix_pull import PULL_MODES
from statecore.routing import DEFAULT_LOAD_TOKENS
from statecore.scheduling import DEFAULT_CHUNK_TOKENS, DEFAULT_STEP_PREFILL_TOKENS

INTERNAL_TOKEN_ENV = "STATECORE_INTERNAL_TOKEN"


def demo_model_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "demo_model"


LOCAL_PREFILL_BELOW_MAX = 1000


def local_prefill_below(chosen: int | None, context_length: int) -> int:
    """The router's threshold: prompts shorter than this prefill on the decode node itself.

    By default an eighth of the model's context, at most 1000 tokens: a fixed 1000 meant a model
    with a short context (the demo model's is 512) never used its prefill node at all."""
    if chosen is not None:
        return chosen
    return min(LOCAL_PREFILL_BELOW_MAX, context_length // 8)


def handoff_rule(threshold: int) -> str:
    """Which prompts go through a prefill node, in words (start-up lines)."""
    if threshold <= 0:
        return "every prompt prefills on a prefill node and hands its KV cache to a decode node"
    return (f"prompts of {threshold} tokens or more prefill on a prefill node and hand their KV "
            f"cache to a decode node; shorter ones prefill on the decode node")


def add_serving_flags(run: argparse.ArgumentParser) -> None:
    """Flags beyond the public contract in cli.py; all optional with sane defaults."""
    serve, router, api, engine, memory, handoff, parallel, security, limits, logging = (
        flag_group(run, group) for group in (SERVE, ROUTER, API, ENGINE, MEMORY, HANDOFF, PARALLEL, SECURITY,
                                             LIMITS, LOGGING))
    router.add_argument("--local-prefill-below", type=whole(0), default=None, metavar="TOKENS",
                        help="router: prompts shorter than this prefill on the decode node, longer ones "
                             "on a prefill node with a KV handoff (default: the model's context / 8, "
                             f"at most {LOCAL_PREFILL_BELOW_MAX})")
    router.add_argument("--force-disaggregation", action="store_true",
                        help="router: send every request through a prefill node")
    handoff.add_argument("--kv-transport", choices=["auto", "shm", "http"], default="auto",
                         help="prefill and decode nodes: how a streamed handoff's pieces move: auto (shared "
                              "memory when the prefill node's advert shows it is on this host, else HTTP), "
                              "shm (shared memory or a kv_shm_gone error), http (never shared memory)")
    handoff.add_argument("--kv-shm-bytes", type=whole(1 << 20), default=None, metavar="BYTES",
                         help="prefill nodes: the most shared memory held for pieces not yet taken "
                              "(default 2 GiB); a piece that finds no room goes over HTTP")
    handoff.add_argument("--kv-port", type=kv_port, default=0, metavar="PORT|auto|off",
                         help="prefill nodes: the port of the KV plane, a plain socket beside the HTTP port "
                              "that writes KV bodies (streamed pieces, pulled caches) to the socket as they "
                              "are; peers learn it from /internal/info and fall back to the HTTP port when "
                              "it cannot be reached (default auto: a free port on the listen address; off: "
                              "KV bodies go through the HTTP port, as they always do under TLS)")
    router.add_argument("--kv-handoff", choices=["stream", "stream-via-decode", "pull"], default="stream",
                        help="router: how a prompt's KV moves from its prefill node to its decode node: "
                             "stream (the router starts the prefill and tells the decode node at once; it "
                             "receives each piece of the KV as the prefill node computes it; the default), "
                             "stream-via-decode (the same stream, but the decode node asks the prefill node "
                             "to prefill: one hop more before the prefill starts), or pull (the decode node "
                             "fetches the whole KV after the first token)")
    router.add_argument("--prefill-overflow", choices=["idle", "on", "off"], default="idle",
                        help="router: when every prefill node already has at least a prompt's worth of "
                             "prefill queued, a decode node with nothing in flight takes the prompt (idle, "
                             "the default: no stream shares its steps with it); on: also a decode node "
                             "whose streams are decoding, if it is prefilling nothing itself (they share "
                             "their steps with the prompt, in layer slices); off: long prompts always wait "
                             "for a prefill node. --force-disaggregation turns it off")
    router.add_argument("--prefix-routing", choices=["on", "off"], default="on",
                        help="router: send a prompt to the node whose prefix cache holds the most of it, "
                             "weighed against load (on, the default), or to the least loaded node (off)")
    router.add_argument("--route-load-tokens", type=whole(0), default=DEFAULT_LOAD_TOKENS, metavar="TOKENS",
                        help="router: what one request in flight on a node weighs against prompt tokens "
                             f"the node would not recompute (default {DEFAULT_LOAD_TOKENS})")
    engine.add_argument("--prefill-chunk-size", type=whole(1), default=None,
                        help="tokens per prefill call, and the prefix cache's block (prompts are reused in "
                             "whole blocks; a block also ends at a chat message's end, see "
                             "--message-blocks); must be equal on every node (default "
                             f"{DEFAULT_CHUNK_TOKENS}; 2048 on MLX's CUDA backend, where smaller calls are "
                             "bound by the host's kernel launches)")
    engine.add_argument("--message-blocks", default="all", choices=("all", "long"),
                        help="where a prefill block also ends right after a chat message's end-of-turn "
                             "token: all (after every one but the prompt's last, in every prompt, so a "
                             "shared system prompt is reused however short the prompts), long (after "
                             "every one, only in prompts longer than a chunk: a shorter one is one call "
                             "and may share a padded call with others, but is never reused); must be "
                             "equal on every node (default all)")
    engine.add_argument("--prefill-stacking", default="off", choices=("auto", "on", "off"),
                        help="compute prompts' short prefill calls of one shape (a burst of first turns "
                             "on one cached system prompt: their last message, then their last token) as "
                             "rows of one call, at the row counts the load check finds computing each row "
                             "as its own call (the same bits): auto (on MLX's CUDA backend), on, off "
                             "(default off: not yet measured on a GPU)")
    engine.add_argument("--shape-bucket", type=whole(0), default=None, metavar="TOKENS",
                        help="pad prefill chunks (and round decode's attended length) up to a multiple "
                             "of this, so the GPU meets few distinct shapes; must be equal on every node "
                             "(default: 128 on MLX's CUDA backend, 0 = off elsewhere)")
    engine.add_argument("--decode-attention", default="auto", metavar="MODE",
                        help="the decode batch's attention (plain-KV models): auto (statecore's CUDA "
                             "kernel on MLX's CUDA backend when its load-time self-check passes; on the "
                             "CPU MLX's masked attention where it gives each row its bits alone, else a "
                             "call a row), kernel (required), masked, rows (a call a row, each over its "
                             "own length), reference (MLX ops; tests) (default auto)")
    engine.add_argument("--compile-decode", default="auto", choices=("auto", "on", "off"),
                        help="trace the decode batch's model call once per shape and replay it "
                             "(mx.compile; plain-KV models): auto (on MLX's CUDA backend), on, off "
                             "(default auto)")
    engine.add_argument("--fuse-projections", default="auto", choices=("auto", "on", "off"),
                        help="compute each layer's query/key/value projections, and its MLP's gate/up "
                             "projections, as one matmul each (fewer kernels per step): auto (on MLX's "
                             "CUDA backend), on, off (default auto)")
    engine.add_argument("--adapter-path", type=Path, default=None, metavar="DIR",
                        help="apply an mlx-lm LoRA/DoRA adapter (a directory with adapter_config.json and "
                             "adapters.safetensors) to the model at load, as mlx-lm applies it; part of the "
                             "model fingerprint: every node of a cluster needs the same one")
    engine.add_argument("--adapters", type=named_adapter, nargs="+", action="extend", default=[],
                        metavar="NAME=PATH",
                        help="LoRA adapters (mlx-lm adapter directories) a request may name in its "
                             "`adapters` field: its rows compute with that adapter, beside rows of other "
                             "adapters and of the base model in the same batch; part of the model "
                             "fingerprint: every node of a cluster needs the same set. Turns the prefix "
                             "cache and the traced decode step off; not with --speculative or "
                             "--adapter-path")
    engine.add_argument("--speculative", default="off", choices=("off", "ngram", "draft"),
                        help="decode and single nodes: speculative decoding while few requests decode "
                             "(--speculative-max-rows): ngram drafts tokens by prompt lookup (what followed "
                             "the latest earlier occurrence of the row's last tokens), draft with "
                             "--draft-model, and a verify step checks them; every token is the one decoding "
                             "without it gives (greedy and seeded); off where the load check finds a verify "
                             "step would compute other numbers (default off; draft when --draft-model is "
                             "given)")
    engine.add_argument("--draft-model", type=Path, default=None, metavar="DIR",
                        help="decode and single nodes: a small model of the same tokenizer that drafts the "
                             "tokens speculative decoding checks (an mlx-lm model directory; plain KV "
                             "cache models)")
    engine.add_argument("--num-draft-tokens", type=whole(1), default=3, metavar="N",
                        help="with --speculative: the most draft tokens a row's verify step checks "
                             "(default 3)")
    engine.add_argument("--speculative-max-rows", type=whole(1), default=1, metavar="N",
                        help="with --speculative: speculate only while at most this many requests "
                             "decode (default 1: a lone stream)")
    engine.add_argument("--kv-bits", type=int, default=None, help="quantize the KV cache (4 or 8)")
    engine.add_argument("--max-batch", type=whole(1), default=32, help="decode batch size (default 32)")
    engine.add_argument("--prefill-batch", type=whole(1), default=32,
                        help="most prompts advanced in one step; short prompts waiting together share one "
                             "padded model call; 1 = one at a time (default 32)")
    engine.add_argument("--max-num-batched-tokens", type=whole(1), default=None,
                        help="tokens one engine step may compute: every decoding row plus prefill work, "
                             "a chunk's layers in slices when the chunk does not fit (default: --max-batch "
                             f"+ {DEFAULT_STEP_PREFILL_TOKENS}, or + --prefill-chunk-size when larger; "
                             "minimum: --max-batch + chunk size / layers)")
    engine.add_argument("--step-target-ms", type=seconds(zero_allowed=True), default=None, metavar="MS",
                        help="while streams decode, size each step's prefill from the step times this node "
                             "measures so that a step stays near MS milliseconds (at least the oldest "
                             "prompt's next slice, at most --max-num-batched-tokens): a long prompt arriving "
                             "stalls no stream for its whole prefill; keep tasks (--keep-conversations) take "
                             "only the room it leaves; 0 = off (default: decode nodes 4 times a step without "
                             "prefill, as measured; single nodes 2 times on the CPU, off on MLX's CUDA "
                             "backend; prefill nodes off)")
    engine.add_argument("--step-target-floors", type=whole(1), default=None, metavar="N",
                        help="without --step-target-ms: the target is N times a step without prefill, as "
                             "measured (on any role; default: decode nodes 4, single nodes 2 on the CPU and "
                             "off on MLX's CUDA backend, prefill nodes off)")
    security.add_argument("--internal-token", default=os.environ.get(INTERNAL_TOKEN_ENV),
                          help="shared secret for internal endpoints (env STATECORE_INTERNAL_TOKEN)")
    api.add_argument("--api-key", type=api_key, action="append", default=[], metavar="KEY",
                     help="single, router: the public API (/v1/*, /tokenize, /detokenize) requires "
                          "'Authorization: Bearer KEY' or 'x-api-key: KEY' (401 otherwise); repeat for "
                          f"several; env {API_KEY_ENV} adds more, comma-separated")
    api.add_argument("--api-key-protects", type=protects, default="", metavar="LIST",
                     help=f"with --api-key: also require it on these paths, open by default "
                          f"(comma-separated of {', '.join(PROTECTABLE)})")
    api.add_argument("--allowed-origins", type=origins, default=None, metavar="ORIGINS",
                     help="single, router: answer CORS for these browser origins (comma-separated, "
                          "* for any); default: no CORS headers")
    security.add_argument("--tls-certfile", default=None, metavar="PATH",
                          help="serve HTTPS with this PEM certificate (chain); needs --tls-keyfile")
    security.add_argument("--tls-keyfile", default=None, metavar="PATH",
                          help="the unencrypted PEM private key of --tls-certfile")
    security.add_argument("--tls-ca-file", default=None, metavar="PATH",
                          help="PEM CA bundle that https:// peers' certificates must chain to (the router's "
                               "calls, a decode node's KV pulls, a local cluster's health checks); default: "
                               "the system's store")
    memory.add_argument("--kv-memory-bytes", type=whole(1), default=None, metavar="BYTES",
                        help="engine nodes: what every KV cache together may take; each request reserves "
                             "its worst case before anything is allocated, and waits (429 with Retry-After) "
                             "or is refused (400 kv_memory_exceeded) otherwise (default: 40%% of the "
                             "device's memory, at most 70%% of it less the weights, divided by "
                             "--device-shared-by)")
    memory.add_argument("--preallocate-slots", default="auto", choices=("auto", "on", "off"),
                        help="decode and single nodes: allocate the slot layout's whole share of "
                             "--kv-memory-bytes at load, so that no request longer than any before "
                             "it grows the buffers (a copy of every row that stalls the streams "
                             "decoding, once per doubling): auto (on MLX's CUDA backend), on, off "
                             "(default auto)")
    memory.add_argument("--device-shared-by", type=whole(1), default=1, metavar="N",
                        help="engine nodes: how many engine nodes share this node's device; the default "
                             "--kv-memory-bytes and MLX's allocator limit are divided among them "
                             "(`statecore run` passes 2 to its prefill and decode nodes on one device) "
                             "(default 1)")
    memory.add_argument("--prefill-memory-cap", default="auto", choices=("auto", "on", "off"),
                        help="engine nodes: cap each step's prefill work so that the KV held and reserved "
                             "plus the step's estimated activations stay within --kv-memory-bytes (the "
                             "oldest prompt still advances, alone if it must): auto (on when "
                             "--kv-memory-bytes is given), on, off (default auto)")
    memory.add_argument("--prefix-cache-bytes", type=whole(0), default=None, metavar="BYTES",
                        help="engine nodes: keep the KV of whole prefill chunks (plain-KV models) for "
                             "prompts that start with the same tokens, within this many bytes of the KV "
                             "budget; kept blocks give way to any request that needs the memory (default: "
                             "a quarter of --kv-memory-bytes; 0 = off)")
    memory.add_argument("--prefix-host-bytes", type=whole(0), default=None, metavar="BYTES",
                        help="engine nodes: a second tier of the prefix cache in host memory, within this "
                             "many bytes: blocks leaving the device are copied there instead of being "
                             "forgotten, and come back on a hit (default: on where the device's memory is "
                             "not the host's, MLX's CUDA backend: 4x --prefix-cache-bytes, at most an eighth "
                             "of the host's memory; 0 = off, the default on unified memory: Apple silicon, "
                             "the CPU backend)")
    # (adapters.mlx.prefix_cache.HOST_PULL_MODES: the pulls' modes; this module loads no MLX)
    memory.add_argument("--prefix-host-pull", choices=PULL_MODES, default="auto",
                        help="engine nodes: when a prompt's next blocks are in the host tier, take them back "
                             "to the device: auto (when the measured copy rate says that is quicker than "
                             "this node's measured prefill, as --prefix-pull auto decides), always, never "
                             "(default auto)")
    memory.add_argument("--keep-conversations", choices=["on", "off"], default="on",
                        help="decode and single nodes: when a request ends normally, compute its prompt and "
                             "generated tokens' whole prefill chunks again and keep them in the prefix "
                             "cache, so the conversation's next turn prefills only its new part (on, the "
                             "default, when the prefix cache is on); under a step-time target this work "
                             "takes only the room the target leaves beside streams")
    memory.add_argument("--prefix-pull", choices=PULL_MODES, default="auto",
                        help="prefill nodes: when the router says the decode node a prompt hands off to "
                             "holds its start in its prefix cache, pull those blocks from it instead of "
                             "computing them: auto (when this node's measured prefill rate says moving "
                             "them is quicker), always (whenever it holds more than this node's own "
                             "cache), never (default auto)")
    handoff.add_argument("--max-kv-bytes", type=whole(1), default=1 << 34,
                         help="decode, prefill: refuse a KV payload (a handoff, a pulled prefix) larger than "
                              "this (default 16 GiB)")
    handoff.add_argument("--kv-buffer-bytes", type=whole(0), default=DEFAULT_KV_BUFFER_BYTES,
                         help="decode, prefill: receive buffers kept for reuse by KV pulls, in bytes "
                              "(default 1 GiB; 0 = a fresh buffer per pull)")
    limits.add_argument("--kv-lease", type=seconds(zero_allowed=False), default=60.0,
                        help="seconds a held KV waits (default 60)")
    limits.add_argument("--request-deadline", type=seconds(zero_allowed=False), default=600.0,
                        help="seconds a request may live (default 600)")
    engine.add_argument("--engine-core", choices=["auto", "thread", "process"], default="auto",
                        help="engine nodes: where the engine core (the model, its KV and the device loop) "
                             "runs: on a thread of the node's process, sharing its GIL with the HTTP front "
                             "end, or in a process of its own, connected by a local socket and shared memory "
                             "for KV (its death is the node's, as a dead device thread's is; not with "
                             "--tensor-parallel or --pipeline-parallel). auto: a process where MLX's CUDA "
                             "backend is installed (measured faster there), a thread elsewhere and for "
                             "tensor- or pipeline-parallel instances (default auto)")
    engine.add_argument("--stall-timeout", type=seconds(zero_allowed=True), default=180.0,
                        help="engine nodes: seconds the engine may be busy without finishing a step "
                             "before the node counts as hung: its requests fail, /health turns 503 and "
                             "it exits 3 for its supervisor to restart (default 180; 0 = never)")
    parallel.add_argument("--tensor-parallel", type=whole(1), default=1, metavar="N",
                          help="prefill, decode, single: run the instance as N processes (ranks), each with "
                               "its tensor-parallel shard of the model (mlx-lm's model.shard: llama, qwen2, "
                               "qwen3, ...), over MLX's distributed runtime; rank 0 serves HTTP. Without "
                               "--hostfile or MLX's launch environment the ranks start on this machine "
                               "(ring backend over 127.0.0.1) (default 1)")
    parallel.add_argument("--pipeline-parallel", type=whole(1), default=1, metavar="N",
                          help="prefill, decode, single: run the instance as N ranks as --tensor-parallel "
                               "does, each holding a share of the model's layers (mlx-lm's pipeline: qwen2, "
                               "qwen3_moe, qwen3_next, qwen3_5, deepseek_v3, glm4_moe, ...; see "
                               "docs/operations.md); not with --tensor-parallel; its caches do not hand off "
                               "(default 1)")
    parallel.add_argument("--distributed-backend", default="ring",
                          choices=("ring", "nccl", "jaccl", "mpi", "any"),
                          help="with --tensor-parallel: MLX's distributed backend (mlx.launch --backend; "
                               "nccl on CUDA, jaccl for RDMA over Thunderbolt) (default ring)")
    parallel.add_argument("--hostfile", default=None, metavar="PATH",
                          help="with --tensor-parallel: start the ranks on these hosts through mlx.launch "
                               "--hostfile (its JSON host list; statecore at the same path on each)")
    limits.add_argument("--drain-timeout", type=seconds(zero_allowed=True), default=30.0,
                        help="seconds to finish in-flight requests on SIGTERM (default 30)")
    limits.add_argument("--max-in-flight", type=whole(1), default=256,
                        help="admission limit: requests beyond it get 429 with Retry-After (default 256)")
    api.add_argument("--chat-template-args", type=template_args, default=None, metavar="JSON",
                     help="single, router: variables for the chat template of every chat, as a JSON "
                          "object of strings, numbers, booleans and nulls (mlx_lm.server's flag, e.g. "
                          "'{\"enable_thinking\": false}'); a request's chat_template_kwargs are put over "
                          "them. Refused at start when the template raises on them")
    api.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="single, router: report in usage the prompt tokens each request's prefill "
                          "took from a prefix cache (prompt_tokens_details.cached_tokens, as vLLM's "
                          "flag; the Responses API's input_tokens_details, Messages' "
                          "cache_read_input_tokens). Off by default: through a cluster that number "
                          "may differ from a single node's")
    # tests only (refused unless ENABLE_ENV=1; docs/operations.md): kept out of --help
    limits.add_argument("--inject-fault", action="append", default=[], help=argparse.SUPPRESS)
    limits.add_argument("--fault-marker", default=DEFAULT_MARKER, help=argparse.SUPPRESS)
    serve.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                       help="serve on this inherited, already listening socket instead of binding "
                            "--host:--port (how `statecore run` and test harnesses start children)")
    logging.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    logging.add_argument("--log-level", default="INFO",
                         help="Python logging level: DEBUG, INFO, WARNING, ERROR (default INFO)")
    logging.add_argument(
        "--log-transitions", action="store_true",
        help="log every request state transition at INFO (they are DEBUG otherwise: each request "
             "logs one INFO line when it ends, each refusal one with its code)")



def resolve_model_flag(args: argparse.Namespace) -> None:
    """`--model` as a directory (a Hugging Face repo id is fetched from the cache or the hub);
    `args.model_given` keeps what the user typed (a local cluster passes it on to its children,
    which find it in the cache), `args.served_model_name` the name clients use for it."""
    args.model_given = args.model
    args.served_model_name = None
    if args.model is None:
        return
    try:
        source = resolve_model(args.model)
    except ModelNotFound as exc:
        raise SystemExit(f"statecore: {exc}") from None
    args.model = source.directory
    args.served_model_name = source.served_name


def resolve_api_keys(args: argparse.Namespace) -> None:
    """`args.api_keys`: every --api-key and STATECORE_API_KEY key with what they protect, or None
    (no key: the public API is open); refused before anything loads when it makes no sense."""
    try:
        keys = keys_from(args.api_key, os.environ.get(API_KEY_ENV))
    except ValueError as exc:
        raise SystemExit(f"statecore: {API_KEY_ENV}: {exc}") from None
    protects = parse_protects(args.api_key_protects)
    if protects and not keys:
        raise SystemExit(f"statecore: --api-key-protects needs --api-key (or {API_KEY_ENV})")
    args.api_keys = ApiKeys(keys, protects) if keys else None

def resolve_engine_core(args: argparse.Namespace) -> None:
    """`--engine-core auto` made `process` or `thread` for an engine node, without importing mlx
    (a node whose core is a process never does): a process where MLX's CUDA backend is installed
    (on the H100 the process core gave 1.15x / 1.30x a thread core's tokens/s on realish at 8 /
    32, docs/performance.md), a thread elsewhere (on the CPU the two cores share the same few
    cores) and for tensor- and pipeline-parallel instances (their ranks run on device threads)."""
    if getattr(args, "engine_core", "thread") != "auto":
        return
    parallel = args.tensor_parallel > 1 or args.pipeline_parallel > 1
    args.engine_core = "process" if not parallel and mlx_cuda_installed() else "thread"


def mlx_cuda_installed() -> bool:
    """Whether MLX's CUDA backend (the `mlx-cuda-*` distribution) is installed beside mlx."""
    return any(re.fullmatch(r"mlx[-_]cuda([-_].*)?", dist.name or "", re.IGNORECASE)
               for dist in importlib.metadata.distributions())


def resolve_tls(args: argparse.Namespace) -> None:
    """`args.tls`: the checked TLS files (`adapters.tls.tls_files`); refused with one line, before
    anything loads, when they cannot work."""
    try:
        args.tls = tls_files(args.tls_certfile, args.tls_keyfile, args.tls_ca_file)
    except TlsConfigError as exc:
        raise SystemExit(f"statecore: {exc}") from None
