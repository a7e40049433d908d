"""Tiny random checkpoints and tokenizers, built fully offline, for tests and benchmarks.
One directory per mlx-lm family whose prompt cache the handoff must carry (llama, qwen3,
gemma3_text, qwen3_next, falcon_h1, mamba2, llama4), in mlx-lm's own layout so that
`mlx_lm.utils.load` reads it like a downloaded model. Weights are random but seeded, and scaled so
that greedy output depends on the whole context; the same arguments give byte-identical files.
Tokenizers (a byte-level BPE, or a SentencePiece-style BPE with byte fallback) are trained here from
built-in text. It imports mlx, mlx_lm and tokenizers; nothing under `src/` may import it (it is
not shipped).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# Notes.
# - All families are dense (qwen3_next: `num_experts: 0`; llama4: `interleave_moe_layer_step` past
#   its last layer), so each runs in every dtype of DTYPES on the CPU backend. Mixture-of-experts
#   layers (`gather_mm`) would run only in float32 there.
# - lm_head rows of special tokens are zero, so these models practically never emit eos
#   (p < 1e-6 per step): generation ends on `max_tokens`.
# - transformers (5.x) validates config.json when it loads the tokenizer, so configs must satisfy
#   both mlx-lm's ModelArgs and transformers' config classes (e.g. llama4's
#   `attn_temperature_tuning` must be a bool there, although mlx-lm types it as int).

__all__ = [
    "CORPUS",
    "DTYPES",
    "FAMILIES",
    "GEMMA3_SLIDING_WINDOW",
    "LLAMA4_ATTENTION_CHUNK",
    "LLAMA4_MIN_LAYERS",
    "TOKENIZER_KINDS",
    "TOKENIZER_VOCAB_SIZE",
    "TokenizerKind",
    "build_custom_cache_checkpoint",
    "build_tiny_checkpoint",
    "build_tokenizer",
    "cached_checkpoint",
    "family_config",
    "greedy_tokens",
    "is_degenerate",
    "main",
]

FAMILIES: tuple[str, ...] = (
    "llama",
    "qwen3",
    "gemma3_text",
    "qwen3_next",
    "falcon_h1",
    "mamba2",
    "llama4",
)
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
TokenizerKind = Literal["bpe", "byte_fallback"]
TOKENIZER_KINDS: tuple[TokenizerKind, ...] = get_args(TokenizerKind)

TOKENIZER_VOCAB_SIZE = 512
"""Both tokenizers have exactly this many tokens, and every model this many embedding rows."""

GEMMA3_SLIDING_WINDOW = 16
"""gemma3_text sliding layers keep this many tokens: prompts of 33 or 257 tokens wrap them."""
LLAMA4_ATTENTION_CHUNK = 32
"""llama4 chunked layers attend within chunks of this many tokens."""
LLAMA4_MIN_LAYERS = 4
"""llama4 reads the cache of layer 4 (its first global layer) for the mask: fewer layers fail."""

# `cached_checkpoint`'s key holds a digest of this file, the builders' source: any change to how
# a checkpoint is made (config, weights, tokenizer, template) moves every cached build aside, with
# nothing to remember to bump.
_BUILDER_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]

_BPE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
_SPM_SPECIALS = ("<unk>", "<s>", "</s>")
_SPM_SPACE = "\u2581"

# Tools in the json_tools style mlx-lm recognises (`<tool_call>` ... `tool_call.name`): the tools
# listed first, an assistant turn's calls as `<tool_call>` JSON, a tool's answer as its own turn.
_TEMPLATE_TOOLS = (
    "{% if tools %}{{ '<tools>\\n' }}{% for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}"
    "{{ '</tools>\\n' }}{% endif %}"
)
_TEMPLATE_CALLS_AND_END = (
    "{% for tool_call in message.get('tool_calls') or [] %}{% set tool_call = tool_call.function %}"
    "{{ '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' + tool_call.arguments | tojson"
    " + '}\\n</tool_call>' }}{% endfor %}"
    "{{ eos_token + '\\n' }}"
    "{% endfor %}"
)
# `date_string` (Llama 3's variable of that name, absent by default) gives `--chat-template-args`
# something to show in the prompt
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if date_string is defined %}{{ '<date>' + date_string + '\\n' }}{% endif %}"
    + _TEMPLATE_TOOLS +
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>\\n' + message['content'] }}" + _TEMPLATE_CALLS_AND_END +
    "{% if add_generation_prompt %}{{ '<assistant>\\n' }}{% endif %}"
)

# A reasoning model's template (DeepSeek-R1's and Qwen3's habits, on the template above): the
# generation prompt opens a think block (`<think>` and `</think>` are tokens of the vocabulary, as
# mlx-lm looks for them), or writes an empty one closed when `enable_thinking` is false; an
# earlier assistant turn shows its `reasoning_content` in a think block; `enable_thinking` that
# is not a boolean makes the template raise, as real templates refuse bad arguments.
THINK_START, THINK_END = "<think>", "</think>"
_THINKING_CHAT_TEMPLATE = (
    "{% if enable_thinking is defined and enable_thinking is not boolean %}"
    "{{ raise_exception('enable_thinking must be true or false') }}{% endif %}"
    "{{ bos_token }}" + _TEMPLATE_TOOLS +
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>\\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] }}" + _TEMPLATE_CALLS_AND_END +
    "{% if add_generation_prompt %}{{ '<assistant>\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)

# Built-in training text for both tokenizers (ASCII only, so byte_fallback must spell any other
# character in `<0xXX>` pieces); also handy as a source of long prompts.
CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the gate.
A small model can still be useful when the test only needs shapes, caches and tokens.
Every request starts in a queue, moves to prefill, hands its cache to a decode node, and ends.
When the network fails, the request fails too, but the node keeps serving the others.
She opened the window, looked at the rain, and decided that the walk could wait until noon.
They built the bridge in three years; it carried trains, trucks, bicycles and people on foot.
In the morning the market sells bread, cheese, apples, pears, onions and fresh green beans.
He wrote the letter twice, because the first version said too much and the second too little.
Numbers matter: 1, 2, 3, 10, 42, 100, 256, 1024 and 65536 appear in many programs.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
if x > 0 and y < 10: result = "inside"
else: result = "outside"
The river runs past the old mill, under the stone bridge, and out into the wide grey sea.
Good tests are small, fast, and honest about what they check; slow tests are rarely run.
Please send the report by Friday, and include the numbers from last week's experiment.
What time is it? It is half past seven, and the train to the city leaves at eight.
Cats sleep for most of the day; dogs prefer to walk, run, play, and eat whatever they find.
The library opens at nine and closes at six, except on Sundays when it is closed all day.
Water boils at one hundred degrees at sea level, and freezes at zero degrees Celsius.
A good cook tastes the soup before serving it, and adds salt only when it is needed.
The orchestra played a quiet piece first, then a loud one, and finally a very long symphony.
Children learn to read by reading, to write by writing, and to count by counting things.
The server answered with status two hundred, a short header, and a body full of tokens.
If the cache is too large to send, the router chooses another node or retries later.
Mountains are cold at the top even in summer, and the air there is thin and clear.
Our team meets every Tuesday to review the plan, the risks, and the results so far.
The museum shows paintings, statues, old maps, coins, and a large model of the city.
Reading a book on a rainy afternoon is one of the simplest pleasures there is.
My grandmother grew tomatoes, beans, carrots, lettuce and herbs in her garden.
The pilot checked the weather, the fuel, the engines, and then asked for permission to fly.
Light travels fast, sound travels slowly, and rumours travel fastest of all.
The old clock in the hall stopped at midnight, and nobody has wound it since then.
Machines follow instructions exactly, which is why the instructions must be exactly right.
At the end of the day the shop keeper counts the money, locks the door and walks home.
Questions, answers, and examples: these are the three parts of every good lesson.
"""


# ---------------------------------------------------------------------------------------------
# Tokenizers


def _corpus_lines() -> list[str]:
    return [line for line in CORPUS.splitlines() if line.strip()]


def _train_bpe(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE (GPT-2 / Llama 3 style): every byte is a base token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(_BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos = _BPE_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    return tok


def _train_byte_fallback() -> Tokenizer:
    """A SentencePiece-style BPE (Llama 2 / Mistral style) with the 256 `<0xXX>` byte pieces.

    Trained on ASCII text only, so any non-ASCII character is encoded as its UTF-8 bytes.
    """
    scratch = Tokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="first")
    n_fixed = len(_SPM_SPECIALS) + 256
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - n_fixed,
        show_progress=False,
    )
    scratch.train_from_iterator(_corpus_lines(), trainer=trainer)
    trained = json.loads(scratch.to_str())["model"]
    pieces = sorted(trained["vocab"].items(), key=lambda item: item[1])

    vocab: dict[str, int] = {}
    for token in _SPM_SPECIALS:
        vocab[token] = len(vocab)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in pieces:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in trained["merges"]]
    if len(vocab) != TOKENIZER_VOCAB_SIZE:
        raise AssertionError(f"byte_fallback vocab has {len(vocab)} tokens")

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="first")
    # Exactly the decoder mlx-lm recognises as SentencePiece (`_is_spm_decoder`).
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    bos = _SPM_SPECIALS[1]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, vocab[bos])],
    )
    return tok


def _specials(kind: TokenizerKind) -> dict[str, str]:
    if kind == "bpe":
        bos, eos, pad = _BPE_SPECIALS
        return {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    unk, bos, eos = _SPM_SPECIALS
    return {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": eos}


def _tokenizer(kind: TokenizerKind, thinking: bool = False) -> Tokenizer:
    if thinking and kind != "bpe":
        raise ValueError("only the bpe tokenizer has a thinking variant")
    if kind == "bpe":
        # the thinking variant: two merges fewer, and the think markers as the last two tokens
        # (ordinary added tokens, not special ones, as Qwen3's are)
        tok = _train_bpe(TOKENIZER_VOCAB_SIZE - 2 if thinking else TOKENIZER_VOCAB_SIZE)
        if thinking:
            tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in (THINK_START, THINK_END)])
        specials = _BPE_SPECIALS
    elif kind == "byte_fallback":
        tok = _train_byte_fallback()
        specials = _SPM_SPECIALS
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {TOKENIZER_KINDS}")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if tok.get_vocab_size(with_added_tokens=True) != TOKENIZER_VOCAB_SIZE:
        raise AssertionError(f"{kind} tokenizer has {tok.get_vocab_size()} tokens")
    named = _specials(kind)
    for role, token_id in _token_ids(kind).items():
        if tok.token_to_id(named[f"{role}_token"]) != token_id:
            raise AssertionError(f"{kind}: {role} token is not id {token_id}")
    return tok


def build_tokenizer(out_dir: Path, kind: TokenizerKind = "bpe", *, thinking: bool = False) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir.
    `thinking`: a reasoning model's tokenizer (bpe only), with think markers and a template
    that opens a think block (`_THINKING_CHAT_TEMPLATE`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(kind, thinking)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    specials = _specials(kind)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": _THINKING_CHAT_TEMPLATE if thinking else _CHAT_TEMPLATE,
        **specials,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", specials)


def _token_ids(kind: TokenizerKind) -> dict[str, int]:
    """Ids of the special tokens of a tokenizer kind (checked against the built tokenizer)."""
    if kind == "bpe":
        return {"bos": 0, "eos": 1, "pad": 2}
    return {"unk": 0, "bos": 1, "eos": 2, "pad": 2}


# ---------------------------------------------------------------------------------------------
# Model configs


def family_config(
    family: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = TOKENIZER_VOCAB_SIZE,
    head_dim: int = 16,
) -> dict[str, Any]:
    """The `config.json` of a tiny model of `family` (without dtype and token ids).

    Heads are `head_dim` wide (16 by default; MLX's CUDA attention kernels want 64 or 128) and
    half as many key/value heads as query heads, so hidden_size must be a multiple of twice
    head_dim (32 by default). llama4 is given at least `LLAMA4_MIN_LAYERS` layers whatever
    num_layers says.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number (RoPE pairs), got {head_dim}")
    if hidden_size < 2 * head_dim or hidden_size % (2 * head_dim):
        raise ValueError(f"hidden_size must be a positive multiple of {2 * head_dim}, got {hidden_size}")
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    heads = hidden_size // head_dim
    kv_heads = max(1, heads // 2)
    common: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": 2 * hidden_size,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    }
    attention: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
    }
    if family == "llama":
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            **common,
            **attention,
            "rope_theta": 10000.0,
        }
    if family == "qwen3":
        return {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            **common,
            **attention,
            "rope_theta": 1000000.0,
        }
    if family == "gemma3_text":
        # Layer i is global iff (i + 1) % sliding_window_pattern == 0: with 2 layers,
        # one RotatingKVCache layer and one KVCache layer.
        return {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            **common,
            **attention,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": head_dim,
            "sliding_window": GEMMA3_SLIDING_WINDOW,
            "sliding_window_pattern": 2,
        }
    if family == "qwen3_next":
        if num_layers < 2:
            raise ValueError("qwen3_next needs at least 2 layers (one linear, one full attention)")
        # Dense: num_experts 0 gives every layer a plain MLP (no gather_mm), so all dtypes run on
        # CPU. Every full_attention_interval-th layer is full attention, the others linear.
        return {
            "model_type": "qwen3_next",
            "architectures": ["Qwen3NextForCausalLM"],
            **common,
            **attention,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 2,
            "linear_num_value_heads": heads,
            "linear_num_key_heads": kv_heads,
            "linear_key_head_dim": head_dim,
            "linear_value_head_dim": head_dim,
            "linear_conv_kernel_dim": 4,
            "num_experts": 0,
            "num_experts_per_tok": 1,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": hidden_size,
            "shared_expert_intermediate_size": hidden_size,
            "norm_topk_prob": True,
        }
    if family == "falcon_h1":
        # Multipliers are left at mlx-lm's defaults; the weights are stored already folded
        # (mlx-lm's sanitize detects that from the conv1d layout and leaves them alone).
        return {
            "model_type": "falcon_h1",
            "architectures": ["FalconH1ForCausalLM"],
            **common,
            **attention,
            "rope_theta": 10000.0,
            "mamba_d_conv": 4,
            "mamba_d_head": head_dim,
            "mamba_n_heads": 2 * heads,
            "mamba_d_ssm": 2 * hidden_size,
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 32,
        }
    if family == "mamba2":
        return {
            "model_type": "mamba2",
            "architectures": ["Mamba2ForCausalLM"],
            **common,
            "num_heads": 2 * heads,
            "head_dim": head_dim,
            "state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_limit": [0.0, 1000.0],
            "time_step_rank": "auto",
        }
    # llama4: the text model nests under text_config. Layers 4, 8, ... are global (KVCache,
    # no RoPE), the others chunked. interleave_moe_layer_step > num_layers: no MoE layer.
    layers = max(num_layers, LLAMA4_MIN_LAYERS)
    text_config = {
        "model_type": "llama4_text",
        **common,
        **attention,
        "num_hidden_layers": layers,
        "intermediate_size_mlp": 2 * hidden_size,
        "attention_bias": False,
        "attention_chunk_size": LLAMA4_ATTENTION_CHUNK,
        "interleave_moe_layer_step": layers + 1,
        "num_local_experts": 1,
        "num_experts_per_tok": 1,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "use_qk_norm": True,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    }
    return {
        "model_type": "llama4",
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text_config,
        "tie_word_embeddings": False,
    }


# ---------------------------------------------------------------------------------------------
# Weights

# Default inits make a random model a bigram table that loops on a few tokens. Instead: unit
# embeddings, matrices with std gain/sqrt(fan_in) so each block adds as much as the residual holds,
# sharper attention (q/k norm scales 2), and an untied lm_head with logits of std ~6 (entropy
# ~1.2 nats). Checked over seeds 0-2, sizes 64x2 to 128x4 and both tokenizers: 32 greedy tokens
# from six prompts were never degenerate and always differed between prompts.
_EMBED_STD = 1.0
_HIDDEN_GAIN = 1.5
_OUTPUT_GAIN = 6.0
_QK_NORM_SCALE = 2.0


def _random_weights(
    family: str, config: dict[str, Any], *, seed: int, dtype: str, special_ids: Sequence[int]
) -> dict[str, mx.array]:
    """Seeded weights for every parameter of the mlx-lm model of `family`, in mlx-lm's layout."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    defaults: dict[str, mx.array] = {}
    tree_flatten(model.parameters(), destination=defaults)
    weights: dict[str, mx.array] = {}
    for name, default in sorted(defaults.items()):
        shape = tuple(default.shape)
        leaf = name.rsplit(".", 1)[-1]
        if len(shape) >= 2:
            if "embed" in name:
                # gemma3 multiplies embeddings by sqrt(hidden_size): undo it, or the token
                # embedding drowns what attention adds and the model turns into a bigram table.
                std = _EMBED_STD / math.sqrt(shape[-1]) if family == "gemma3_text" else _EMBED_STD
            elif "conv1d" in name:
                std = _HIDDEN_GAIN / math.sqrt(math.prod(shape[1:]))
            elif name.endswith("lm_head.weight"):
                std = _OUTPUT_GAIN / math.sqrt(shape[-1])
            else:
                std = _HIDDEN_GAIN / math.sqrt(shape[-1])
            value = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            if name.endswith("lm_head.weight"):
                value[list(special_ids)] = 0.0  # never (well, p < 1e-6) emit bos/eos/pad
        elif leaf == "A_log":
            value = np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        elif leaf == "bias":
            value = np.zeros(shape, dtype=np.float32)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            # Sharper attention than RMS-normed queries and keys give with unit scales.
            value = np.full(shape, _QK_NORM_SCALE, dtype=np.float32)
        elif leaf in ("weight", "D", "dt_bias"):
            # Norm scales (ones), the SSM skip D (ones) and dt_bias (ones): fixed defaults.
            value = np.array(default, dtype=np.float32)
            if not np.all(value == 1.0):
                raise AssertionError(f"{family}: unexpected default for {name}")
        else:
            raise AssertionError(f"{family}: no init rule for parameter {name} {shape}")
        weights[name] = mx.array(value).astype(getattr(mx, dtype))
    return weights


# ---------------------------------------------------------------------------------------------
# Checkpoints


def build_tiny_checkpoint(
    out_dir: Path,
    family: str,
    *,
    dtype: str = "float32",
    tokenizer: TokenizerKind = "bpe",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    thinking: bool = False,
    head_dim: int = 16,
) -> Path:
    """Write a random `family` model that `mlx_lm.utils.load(out_dir)` loads; return out_dir.
    `thinking`: with the reasoning model's tokenizer and template (`build_tokenizer`);
    `head_dim`: its attention heads' width (`family_config`).

    Same arguments give byte-identical files.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {TOKENIZER_KINDS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = family_config(family, hidden_size=hidden_size, num_layers=num_layers, head_dim=head_dim)
    ids = _token_ids(tokenizer)
    weights = _random_weights(family, config, seed=seed, dtype=dtype, special_ids=sorted(set(ids.values())))
    config |= {
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": dtype,
    }
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
    build_tokenizer(out_dir, tokenizer, thinking=thinking)
    return out_dir


_CUSTOM_MODEL_FILE = "opaque_cache_model.py"
_CUSTOM_MODEL_SOURCE = '''\
"""A llama whose prompt cache is a class of its own: a statecore test fixture.

Loaded by mlx-lm through the `model_file` config key (needs trust_remote_code=True). The cache
subclasses nothing from mlx-lm, and its `state` holds a plain Python object next to the arrays,
so no KV codec can carry it: a disaggregated server must refuse to hand it off.
"""

import mlx.core as mx
from mlx_lm.models import llama

ModelArgs = llama.ModelArgs


class Ledger:
    """Plain Python bookkeeping inside the cache state."""

    def __init__(self):
        self.updates = []


class OpaqueCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0
        self.ledger = Ledger()

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        self.ledger.updates.append(keys.shape[2])
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values, self.ledger

    def is_trimmable(self):
        return False

    def size(self):
        return self.offset

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class Model(llama.Model):
    def make_cache(self):
        return [OpaqueCache() for _ in self.layers]
'''


def build_custom_cache_checkpoint(out_dir: Path, *, seed: int = 0) -> Path:
    """Write a tiny llama that brings its own architecture file and cache class; return out_dir.

    `config.json` names `opaque_cache_model.py` under `model_file`, so mlx-lm 0.32.2 refuses to
    load it unless `trust_remote_code=True` (a ValueError). Its `make_cache()` returns
    `OpaqueCache` objects: not mlx-lm classes, with a Python object in `state`. It generates
    normally on one node; the handoff must refuse it cleanly.
    """
    out_dir = build_tiny_checkpoint(out_dir, "llama", seed=seed)
    config = json.loads((out_dir / "config.json").read_text(encoding="utf-8"))
    # model_type names no mlx-lm module: only model_file can build it.
    config |= {"model_type": "statecore_opaque", "model_file": _CUSTOM_MODEL_FILE}
    config["architectures"] = ["OpaqueCacheLlama"]
    _write_json(out_dir / "config.json", config)
    (out_dir / _CUSTOM_MODEL_FILE).write_text(_CUSTOM_MODEL_SOURCE, encoding="utf-8")
    return out_dir


def _cache_root(root: Path | None) -> Path:
    if root is not None:
        return Path(root)
    env = os.environ.get("STATECORE_TINY_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "statecore" / "tiny"


def cached_checkpoint(
    family: str,
    *,
    dtype: str = "float32",
    tokenizer: TokenizerKind = "bpe",
    root: Path | None = None,
    **kw: Any,
) -> Path:
    """`build_tiny_checkpoint` once into a cache directory, then reuse it.

    The cache lives in `root`, else `$STATECORE_TINY_CACHE`, else `~/.cache/statecore/tiny`,
    under a key made of every argument, the mlx-lm version and a digest of this file's source.
    Concurrent callers are safe: each builds into a temporary directory and renames it into
    place; the loser of a race discards its copy and uses the winner's.
    `kw` passes seed, hidden_size, num_layers and thinking through.
    """
    from mlx_lm import __version__ as mlx_lm_version

    allowed = {"seed", "hidden_size", "num_layers", "thinking"}
    if unknown := set(kw) - allowed:
        raise TypeError(f"cached_checkpoint got unexpected arguments {sorted(unknown)}")
    key_fields = {
        "family": family,
        "dtype": dtype,
        "tokenizer": tokenizer,
        "mlx_lm": mlx_lm_version,
        "builder": _BUILDER_DIGEST,
        **kw,
    }
    digest = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:12]
    base = _cache_root(root)
    final = base / f"{family}-{dtype}-{tokenizer}-{digest}"
    if (final / "config.json").exists():
        return final
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=base))
    try:
        build_tiny_checkpoint(scratch, family, dtype=dtype, tokenizer=tokenizer, **kw)
        try:
            os.rename(scratch, final)
        except OSError:
            # Another process won the race (the target exists and is not empty).
            if not (final / "config.json").exists():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------
# Checks


def is_degenerate(tokens: Sequence[int]) -> bool:
    """True when a generated sequence is what a broken random model produces.

    Fewer than 4 distinct tokens, or one token making up more than half of them.
    """
    if not tokens:
        return True
    counts = Counter(tokens)
    return len(counts) < 4 or counts.most_common(1)[0][1] * 2 > len(tokens)


def greedy_tokens(model: Any, prompt: Sequence[int], max_tokens: int = 32) -> list[int]:
    """Greedy continuation of `prompt` through mlx-lm's `generate_step`, ignoring eos."""
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m support.tiny_models OUT_DIR --family llama --dtype float32 --tokenizer bpe`."""
    parser = argparse.ArgumentParser(prog="python -m support.tiny_models", description=__doc__)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default="bpe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument(
        "--custom-cache",
        action="store_true",
        help="build the llama with its own model_file and OpaqueCache instead",
    )
    args = parser.parse_args(argv)
    if args.custom_cache:
        out = build_custom_cache_checkpoint(args.out_dir, seed=args.seed)
    else:
        out = build_tiny_checkpoint(
            args.out_dir,
            args.family,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
        )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
