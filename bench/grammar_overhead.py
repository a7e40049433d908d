"""What grammar-constrained decoding costs per token on this machine, for each candidate library.

The candidates are llguidance, xgrammar and outlines-core. Each one gets the same JSON schemas and
the same vocabularies: the tiny tokenizer (512 tokens), the demo model's (4,096), and two
byte-level BPEs of 32,000 and 128,000 tokens trained here on the Python standard library's sources
(a realistic vocabulary size without a download; about 15 s each, cached under --cache). Three
numbers per library:

1. `compile_ms`: building the grammar for one schema and vocabulary (the engine caches it per
   (tokenizer, format)).
2. `per_token_us`: computing the allowed-token bitmask and then consuming the token, for every
   token of a fixed valid JSON document (a fixed path, so the libraries do the same work). Each
   document token is checked against the mask: a library that would refuse it fails the run.
3. `decode`: the demo model (llama, 4,096 tokens) decoding greedily under the bounded schema, the
   mask applied on the device before the argmax and the token read back before the next mask.
   The same script also decodes without a grammar, pipelined the way mlx-lm's `generate_step`
   does (`ratio` = constrained ms/token over that) and without a grammar but with the same
   read-back (`sync_ratio`), which separates what the lost overlap costs from the library's share.
4. `engine`: `MlxEngine` itself (llguidance, the library it uses) on the demo model: a batch of
   `--engine-rows` requests decoding `--engine-tokens` each, none, one or all of them under a
   grammar that runs that long (a JSON string); ms per device step (`step_ratio` against none).

llguidance is the project's own dependency; outlines-core is not (`.venv/bin/pip install
outlines-core==0.2.14` to measure it). xgrammar imports torch at import time (its wheel depends on
torch and, on Linux, the CUDA wheels: 5.6 GB installed); it is measured only when it can be
imported, e.g. with `--extra-path DIR` after `pip install --target DIR xgrammar==0.2.9`. Missing
libraries are reported, not fatal. outlines-core takes one whitespace pattern for every place in the JSON
(here `[ ]?`), so its greedy document may differ from the others' in spaces.

    .venv/bin/python bench/grammar_overhead.py --out grammar.json
    .venv/bin/python bench/grammar_overhead.py --extra-path /tmp/xgr --vocabs demo,bpe128k

Bench code: may import anything; nothing under src/ imports it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))  # support/: the tiny checkpoints

# The bounded schema of the engine tests, and one of the shape a real API client sends.
SCHEMAS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "bounded": (
        {"type": "object",
         "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
         "required": ["ok", "color"], "additionalProperties": False},
        {"ok": True, "color": "green"},
    ),
    "nested": (
        {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
         "properties": {
             "name": {"type": "string"},
             "age": {"type": "integer"},
             "tags": {"type": "array", "items": {"type": "string"}},
             "address": {"type": "object", "additionalProperties": False, "required": ["street", "city"],
                         "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                        "zip": {"type": "string"}}},
         }},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
         "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}},
    ),
    "json_object": (
        {"type": "object"},
        {"id": 7, "items": [1, 2.5, None, False], "note": "any object at all", "nested": {"k": "v"}},
    ),
}
SEPARATORS = (", ", ": ")  # what json.dumps writes: the engine's choice (no free whitespace)


# ---------------------------------------------------------------------------------------------
# Vocabularies


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    chars = visible[:]
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def _stdlib_texts() -> Iterator[str]:
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            yield path.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue


def _trained_bpe(size: int, cache: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache / f"stdlib-bpe-{size}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=["<|eos|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_stdlib_texts(), trainer=trainer)
    cache.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


class Vocab:
    """A byte-level BPE as each library wants it: an HF fast tokenizer, the eos id, token bytes."""

    def __init__(self, name: str, tokenizer: Any, eos: int) -> None:
        from transformers import PreTrainedTokenizerFast

        self.name = name
        self.tokenizer = tokenizer
        self.eos = eos
        self.size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer,  # type: ignore[no-untyped-call]
                                          eos_token=tokenizer.id_to_token(eos))
        decoder = _byte_decoder()
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        self.token_bytes: dict[int, bytes] = {}
        for token_id in range(self.size):
            piece = tokenizer.id_to_token(token_id)
            if piece is None or piece in specials:
                continue
            self.token_bytes[token_id] = bytes(decoder[c] for c in piece)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)


def load_vocab(name: str, cache: Path) -> Vocab:
    from tokenizers import Tokenizer

    if name == "tiny":
        from support.tiny_models import build_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            build_tokenizer(Path(tmp), "bpe")
            return Vocab(name, Tokenizer.from_file(str(Path(tmp) / "tokenizer.json")), 1)
    if name == "demo":
        return Vocab(name, Tokenizer.from_file(str(REPO / "src/adapters/demo_model/tokenizer.json")), 2)
    size = {"bpe32k": 32_000, "bpe128k": 128_000}[name]
    return Vocab(name, _trained_bpe(size, cache), 0)


# ---------------------------------------------------------------------------------------------
# The libraries, behind one small interface


class Matcher(Protocol):
    def fill(self, bitmask: Any) -> None: ...  # the (words,) int32 bitmask of allowed tokens
    def consume(self, token: int) -> None: ...
    def reset(self) -> None: ...


class Library(Protocol):
    name: str

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Matcher: ...


class _Ll:
    def __init__(self, m: Any) -> None:
        self.m = m

    def fill(self, bitmask: Any) -> None:
        self.m.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def consume(self, token: int) -> None:
        if not self.m.consume_token(token):
            raise RuntimeError(self.m.get_error())

    def reset(self) -> None:
        self.m.reset()


class Llguidance:
    name = "llguidance"

    def __init__(self, vocab: Vocab) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(vocab.hf, n_vocab=vocab.size, eos_token=vocab.eos)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, overrides={
            "whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)  # the check happens here
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Matcher:
        return _Ll(self.ll.LLMatcher(self.tokenizer, compiled))


class _Xg:
    def __init__(self, m: Any, torch: Any) -> None:
        self.m, self.torch = m, torch

    def fill(self, bitmask: Any) -> None:
        self.m.fill_next_token_bitmask(self.torch.from_numpy(bitmask[None]))

    def consume(self, token: int) -> None:
        if not self.m.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")

    def reset(self) -> None:
        self.m.reset()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, vocab: Vocab) -> None:
        import torch  # type: ignore[import-not-found]
        import xgrammar  # type: ignore[import-not-found]

        self.xg, self.torch = xgrammar, torch
        info = xgrammar.TokenizerInfo.from_huggingface(vocab.hf, vocab_size=vocab.size,
                                                       stop_token_ids=[vocab.eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=SEPARATORS, strict_mode=True)

    def matcher(self, compiled: Any) -> Matcher:
        return _Xg(self.xg.GrammarMatcher(compiled), self.torch)


class _Oc:
    def __init__(self, guide: Any) -> None:
        self.g = guide

    def fill(self, bitmask: Any) -> None:
        self.g.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def consume(self, token: int) -> None:
        self.g.advance(token, return_tokens=False)

    def reset(self) -> None:
        self.g.reset()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, vocab: Vocab) -> None:
        import outlines_core  # type: ignore[import-untyped]

        self.oc = outlines_core
        grouped: dict[bytes, list[int]] = {}
        for token_id, raw in vocab.token_bytes.items():
            grouped.setdefault(raw, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos, grouped)

    def compile(self, schema: dict[str, Any]) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Matcher:
        return _Oc(self.oc.Guide(compiled))


LIBRARIES: dict[str, Callable[[Vocab], Library]] = {
    "llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def _allowed(bitmask: Any, token: int) -> bool:
    return bool((int(bitmask[token // 32]) >> (token % 32)) & 1)


def per_token(lib: Library, vocab: Vocab, schema: dict[str, Any], doc: Any, reps: int) -> dict[str, Any]:
    started = time.perf_counter()
    compiled = lib.compile(schema)
    compile_ms = 1000 * (time.perf_counter() - started)
    tokens = vocab.encode(json.dumps(doc, separators=SEPARATORS))
    matcher = lib.matcher(compiled)
    bitmask = np.zeros(((vocab.size + 31) // 32,), dtype=np.int32)
    samples: list[float] = []
    for rep in range(reps + 1):
        matcher.reset()
        started = time.perf_counter()
        for token in tokens:
            matcher.fill(bitmask)
            if rep == 0 and not _allowed(bitmask, token):
                raise RuntimeError(f"{lib.name} masks out token {token} of the document")
            matcher.consume(token)
        matcher.fill(bitmask)  # the last mask: only EOS
        if rep == 0:
            if not _allowed(bitmask, vocab.eos):
                raise RuntimeError(f"{lib.name} does not allow EOS after the document")
            continue  # warm-up (and the correctness pass)
        samples.append((time.perf_counter() - started) / (len(tokens) + 1))
    return {"compile_ms": round(compile_ms, 2), "tokens": len(tokens),
            "per_token_us": round(1e6 * statistics.median(samples), 2)}


# ---------------------------------------------------------------------------------------------
# Decoding with the demo model: constrained against unconstrained


def _mask_on_device(bitmask: Any, vocab: int) -> Any:
    """The bitmask's (vocab,) booleans, unpacked on the device (vocab / 8 bytes cross over)."""
    words = mx.array(bitmask.view(np.uint32))
    bits = (words[:, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return bits.reshape(-1)[:vocab].astype(mx.bool_)


def decode(model: Any, prompt: list[int], steps: int, eos: set[int], matcher: Matcher | None,
           synced: bool, vocab: int) -> tuple[list[int], float]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    bitmask = np.zeros(((vocab + 31) // 32,), dtype=np.int32)

    def step(token: Any) -> Any:
        logits = model(token.reshape(1, 1), cache=cache)[:, -1, :]
        if matcher is not None:
            matcher.fill(bitmask)
            logits = mx.where(_mask_on_device(bitmask, vocab), logits, -mx.inf)
        return mx.argmax(logits, axis=-1)

    token = mx.array([prompt[-1]])
    out: list[int] = []
    mx.eval(cache[0].state)
    started = time.perf_counter()
    if matcher is None and not synced:  # generate_step's pipelining: read step N while N+1 runs
        nxt = step(token)
        mx.async_eval(nxt)  # type: ignore[no-untyped-call]
        for _ in range(steps - 1):
            token = nxt
            nxt = step(token)
            mx.async_eval(nxt)  # type: ignore[no-untyped-call]
            out.append(int(token.item()))
        out.append(int(nxt.item()))
    else:
        for _ in range(steps):
            token = step(token)
            value = int(token.item())
            out.append(value)
            if matcher is not None:
                if value in eos:
                    break
                matcher.consume(value)
    return out, time.perf_counter() - started


def decode_ratios(libs: dict[str, Library], vocab: Vocab, reps: int) -> dict[str, Any]:
    from mlx_lm.utils import load

    model, tokenizer = load(str(REPO / "src/adapters/demo_model"))[:2]
    messages = [{"role": "user", "content": "Answer in JSON: is the sky green? Pick a colour too."}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))  # type: ignore[no-untyped-call]
    eos = {vocab.eos}
    schema = SCHEMAS["bounded"][0]
    results: dict[str, Any] = {}
    reference: list[int] | None = None
    for name, lib in libs.items():
        matcher = lib.matcher(lib.compile(schema))
        times = []
        for _ in range(reps + 1):
            matcher.reset()
            tokens, seconds = decode(model, prompt, 64, eos, matcher, True, vocab.size)
            times.append(seconds / len(tokens))
        text = tokenizer.decode([t for t in tokens if t not in eos])
        json.loads(text)  # parses, or the run fails
        # Libraries may differ where a token spans a grammar boundary (e.g. `"}`): greedy then
        # takes another path, of another length; the times are per token.
        reference = reference or tokens
        results[name] = {"ms_per_token": 1000 * statistics.median(times[1:]), "tokens": len(tokens),
                         "text": text, "same_tokens_as_first": tokens == reference}
    assert reference is not None
    steps = len(reference)
    plain = [decode(model, prompt, steps, eos, None, False, vocab.size)[1] / steps for _ in range(reps + 1)]
    synced = [decode(model, prompt, steps, eos, None, True, vocab.size)[1] / steps for _ in range(reps + 1)]
    plain_ms = 1000 * statistics.median(plain[1:])
    synced_ms = 1000 * statistics.median(synced[1:])
    for entry in results.values():
        entry["ratio"] = round(entry["ms_per_token"] / plain_ms, 3)
        entry["sync_ratio"] = round(entry["ms_per_token"] / synced_ms, 3)
        entry["ms_per_token"] = round(entry["ms_per_token"], 3)
    return {"unconstrained_ms_per_token": round(plain_ms, 3), "unconstrained_synced_ms_per_token":
            round(synced_ms, 3), "constrained": results}


# ---------------------------------------------------------------------------------------------
# The engine itself: what constrained rows cost a batch (MlxEngine, llguidance)


def engine_ratios(rows: int, max_tokens: int, reps: int) -> dict[str, Any]:
    """A batch of `rows` requests on the demo model, none, one or all of them under a grammar
    that runs to max_tokens (a JSON string); ms per device step, each scenario against the free one."""
    import trio

    from adapters.grammar import response_format_text
    from adapters.mlx import MlxEngine
    from effects.engine_port import SamplingParams
    from statecore.ids import RequestId

    free = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens,
                                 response_format=response_format_text("json_schema", {"type": "string"}))
    scenarios = {"free": 0, "one_constrained": 1, "all_constrained": rows}

    async def run() -> dict[str, Any]:
        engine = await MlxEngine.load(REPO / "src/adapters/demo_model", max_batch=rows)
        out: dict[str, Any] = {}

        async def one(rid: RequestId, i: int, sampling: SamplingParams, counted: list[int]) -> None:
            prompt = [1, *range(40 + 7 * i, 70 + 7 * i)]
            first = await engine.prefill(rid, prompt, sampling)
            await engine.decode_held(rid, prompt, first.first_token, sampling)
            counted.append(1 + len([g async for g in engine.stream(rid)]))

        try:
            for attempt in range(reps + 1):
                for name, constrained_rows in scenarios.items():
                    before = engine.device_profile()["step"]
                    counted: list[int] = []
                    started = time.perf_counter()
                    async with trio.open_nursery() as nursery:
                        for i in range(rows):
                            sampling = constrained if i < constrained_rows else free
                            nursery.start_soon(one, RequestId(f"{name}-{attempt}-{i}"), i, sampling, counted)
                    tokens = sum(counted)
                    after = engine.device_profile()["step"]
                    if attempt == 0:
                        continue  # warm-up
                    entry = out.setdefault(name, {"ms_per_step": [], "tokens_per_s": []})
                    entry["ms_per_step"].append(1000 * (after[1] - before[1]) / (after[0] - before[0]))
                    entry["tokens_per_s"].append(tokens / (time.perf_counter() - started))
        finally:
            await engine.aclose()
        base = statistics.median(out["free"]["ms_per_step"])
        return {name: {"ms_per_step": round(statistics.median(e["ms_per_step"]), 3),
                       "tokens_per_s": round(statistics.median(e["tokens_per_s"]), 1),
                       "step_ratio": round(statistics.median(e["ms_per_step"]) / base, 3)}
                for name, e in out.items()}

    return {"rows": rows, "max_tokens": max_tokens, **trio.run(run)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", default="tiny,demo,bpe32k,bpe128k")
    parser.add_argument("--libraries", default=",".join(LIBRARIES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "statecore-grammar-bench")
    parser.add_argument("--extra-path", action="append", default=[],
                        help="appended to sys.path (e.g. a --target install of xgrammar and torch)")
    parser.add_argument("--engine-rows", type=int, default=4,
                        help="the engine section's batch (0: skip it)")
    parser.add_argument("--engine-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.extend(args.extra_path)
    from adapters.blas import blas_in_use

    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), "mlx": importlib.metadata.version("mlx"),
                    "device": str(mx.default_device()), "blas": blas_in_use()},
        "versions": {}, "skipped": {}, "per_token": {}, "decode": None,
    }
    for lib_name in args.libraries.split(","):
        module = {"llguidance": "llguidance", "xgrammar": "xgrammar",
                  "outlines-core": "outlines_core"}[lib_name]
        try:
            __import__(module)
            report["versions"][lib_name] = importlib.metadata.version(lib_name)
        except Exception as exc:
            report["skipped"][lib_name] = f"{type(exc).__name__}: {exc}"
    chosen = [name for name in args.libraries.split(",") if name in report["versions"]]
    for vocab_name in args.vocabs.split(","):
        vocab = load_vocab(vocab_name, args.cache)
        libs = {name: LIBRARIES[name](vocab) for name in chosen}
        for name, lib in libs.items():
            for schema_name, (schema, doc) in SCHEMAS.items():
                key = f"{vocab_name}/{vocab.size}/{schema_name}"
                entry = per_token(lib, vocab, schema, doc, args.reps)
                report["per_token"].setdefault(key, {})[name] = entry
                print(key, name, entry, file=sys.stderr, flush=True)
        if vocab_name == "demo":
            report["decode"] = decode_ratios(libs, vocab, args.reps)
            print("decode", report["decode"], file=sys.stderr, flush=True)
    if args.engine_rows:
        report["engine"] = engine_ratios(args.engine_rows, args.engine_tokens, args.reps)
        print("engine", report["engine"], file=sys.stderr, flush=True)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
