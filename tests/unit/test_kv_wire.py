"""The KV wire codec: bit-exact round trips for every mlx-lm cache family, and strict rejection.

Tiny models are built in memory from mlx-lm's model classes (random weights, hidden size 32-64),
prefilled with prompt[:-1] the way the engine does it; the decoded caches must then give
bitwise identical logits to the originals for the next steps. Corruption tests check the error
code of every kind of damage; hypothesis checks that no mutation escapes as anything other
than `StatecoreError`.
"""

from __future__ import annotations

import functools
import json
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import falcon_h1, gemma3_text, llama, llama4, mamba2, qwen3_next

from adapters.kv import frames
from adapters.kv.codec import (
    DecodedKv,
    decode_cache,
    encode_cache,
    host_tensors,
    kv_piece_tensors,
    raw_tensor_bytes,
    travel_report,
    wire_view,
)
from adapters.kv.frames import (
    ALL_HEADS_VERSION,
    END_FRAME_BYTES,
    FORMAT_VERSION,
    MAGIC,
    READ_VERSIONS,
    HostTensors,
    encoded_size,
    end_frame,
    end_frame_in_background,
    frame_payload,
    unsealed_pieces,
)
from statecore.errors import Code, StatecoreError

C: Any = mlx_cache  # mlx-lm is untyped; one Any here keeps the calls below checked-free
VOCAB = 128
FP = "tiny-test-model:v1"
PREFILL_CHUNK = 2048  # mlx-lm's default prefill step; every node must use the same one

# --------------------------------------------------------------------------- tiny models


def _llama() -> Any:
    return llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            rms_norm_eps=1e-5,
            vocab_size=VOCAB,
        )
    )


def _gemma3() -> Any:
    return gemma3_text.Model(
        gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            head_dim=32,
            num_key_value_heads=1,
            vocab_size=VOCAB,
            query_pre_attn_scalar=32,
            sliding_window=16,
            sliding_window_pattern=2,
        )
    )


def _qwen3_next() -> Any:
    return qwen3_next.Model(
        qwen3_next.ModelArgs(
            model_type="qwen3_next",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=0,
            num_experts_per_tok=0,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=0,
            mlp_only_layers=[],
            moe_intermediate_size=0,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            num_key_value_heads=1,
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            max_position_embeddings=4096,
            head_dim=32,
            full_attention_interval=2,
        )
    )


def _falcon_h1() -> Any:
    falcon: Any = falcon_h1
    return falcon.Model(
        falcon.ModelArgs(
            hidden_size=64,
            head_dim=16,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=128,
            mamba_d_conv=4,
            mamba_d_head=16,
            mamba_d_ssm=64,
            mamba_d_state=16,
            mamba_n_heads=4,
            mamba_n_groups=1,
            mamba_chunk_size=16,
            vocab_size=VOCAB,
        )
    )


def _mamba2() -> Any:
    return mamba2.Model(
        mamba2.ModelArgs(
            model_type="mamba2",
            num_heads=4,
            head_dim=16,
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            state_size=16,
            num_hidden_layers=2,
            layer_norm_epsilon=1e-5,
            conv_kernel=4,
            n_groups=1,
            use_bias=False,
            use_conv_bias=True,
            tie_word_embeddings=True,
            time_step_limit=(0.0, float("inf")),
            time_step_rank="auto",
        )
    )


def _llama4() -> Any:
    text = {
        "attention_bias": False,
        "attention_chunk_size": 16,
        "head_dim": 16,
        "hidden_size": 64,
        "interleave_moe_layer_step": 100,  # no MoE layer among the 4 (MoE is float32-only on CPU)
        "intermediate_size": 128,
        "intermediate_size_mlp": 128,
        "max_position_embeddings": 4096,
        "model_type": "llama4_text",
        "num_attention_heads": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "use_qk_norm": True,
        "vocab_size": VOCAB,
    }
    return llama4.Model(llama4.ModelArgs(model_type="llama4", text_config=text))


FAMILIES: dict[str, Callable[[], Any]] = {
    "llama": _llama,  # KVCache
    "gemma3_text": _gemma3,  # RotatingKVCache + KVCache
    "qwen3_next": _qwen3_next,  # ArraysCache + KVCache
    "falcon_h1": _falcon_h1,  # CacheList(ArraysCache, KVCache)
    "mamba2": _mamba2,  # ArraysCache
    "llama4": _llama4,  # ChunkedKVCache + KVCache
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@functools.cache
def _model(family: str, dtype: str) -> Any:
    mx.random.seed(1234)
    model = FAMILIES[family]()
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n)]


def _feed(model: Any, tokens: Sequence[int], cache: list[Any]) -> mx.array:
    logits: mx.array = model(mx.array(list(tokens))[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


def _prefill(model: Any, prompt: Sequence[int], cache: list[Any] | None = None) -> list[Any]:
    """prompt[:-1] in fixed chunks, as the engine's prefill does; the last token is left."""
    cache = C.make_prompt_cache(model) if cache is None else cache
    body = prompt[:-1]
    for start in range(0, len(body), PREFILL_CHUNK):
        _feed(model, body[start : start + PREFILL_CHUNK], cache)
    return cache


def _bits(a: mx.array) -> np.ndarray[Any, Any]:
    return np.array(a.reshape(-1).view(mx.uint8))


def _roundtrip(cache: list[Any], token_count: int = 0, **kw: Any) -> DecodedKv:
    frames = encode_cache(cache, fingerprint=FP, token_count=token_count, **kw)
    names = [type(c).__name__ for c in cache]
    return decode_cache(b"".join(frames), fingerprint=FP, expected_classes=names)


def _assert_same_continuation(
    model: Any, original: list[Any], restored: list[Any], first: Sequence[int], steps: int = 3
) -> None:
    """Feed `first`, then greedy tokens, to both caches: logits must match bit for bit."""
    tokens = list(first)
    for step in range(steps):
        a = _feed(model, tokens, original)
        b = _feed(model, tokens, restored)
        assert a.dtype == b.dtype
        assert np.array_equal(_bits(a), _bits(b)), f"logits differ at step {step}"
        tokens = [int(np.argmax(np.array(a[0, -1].astype(mx.float32))))]


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("length", [1, 33, 257])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_exact(family: str, dtype: str, length: int) -> None:
    model = _model(family, dtype)
    prompt = _prompt(length)
    original = _prefill(model, prompt)
    assert all(layer.can_travel for layer in travel_report(original))
    decoded = _roundtrip(original, token_count=length - 1)
    assert decoded.token_count == length - 1
    assert decoded.class_names == tuple(type(c).__name__ for c in original)
    assert [type(c) for c in decoded.caches] == [type(c) for c in original]
    _assert_same_continuation(model, original, decoded.caches, prompt[-1:])


@pytest.mark.parametrize("length", [1, 33, 257])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_round_trip_is_bit_exact(bits: int, dtype: str, length: int) -> None:
    model = _model("llama", dtype)
    prompt = _prompt(length, seed=bits)
    quantized = [C.QuantizedKVCache(group_size=32, bits=bits) for _ in model.layers]
    original = _prefill(model, prompt, quantized)
    decoded = _roundtrip(original)
    if length > 1:  # packed data, scales and biases are all cut to the live tokens
        arrays = list(decoded.caches[0].state[0])
        assert [x.shape[-2] for x in arrays] == [length - 1] * 3
        assert arrays[0].dtype == mx.uint32
    _assert_same_continuation(model, original, decoded.caches, prompt[-1:])


# (prefill length, single-token steps before the handoff) against a window of 16
ROTATING_CASES = {
    "short": (9, 0),  # 8 tokens, buffer exactly full of them
    "growing": (9, 3),  # in place, not wrapped: the step-sized buffer has an unwritten tail
    "whole_prompt": (41, 0),  # one 40-token update: holds the whole prompt, 40 > 16
    "wrapped": (41, 20),  # in place past the window: rotated, not in temporal order
    "wrapped_exactly": (17, 16),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(ROTATING_CASES))
def test_rotating_cache_round_trip(case: str, dtype: str) -> None:
    model = _model("gemma3_text", dtype)
    length, steps = ROTATING_CASES[case]
    prompt = _prompt(length + steps, seed=7)
    original = _prefill(model, prompt[: length + 1])
    for token in prompt[length : length + steps]:
        _feed(model, [token], original)
    rotating = original[0]
    assert type(rotating) is C.RotatingKVCache
    decoded = _roundtrip(original).caches
    window = decoded[0].state[0].shape[2]
    assert window == min(rotating.offset, 16), "only the window travels"
    # one token at a time (in place), and a multi-token chunk (concatenation) afterwards
    _assert_same_continuation(model, original, decoded, prompt[-1:], steps=20)
    _assert_same_continuation(model, original, decoded, _prompt(5, seed=8), steps=2)


@pytest.mark.parametrize("keep", [0, 4])
@pytest.mark.parametrize("case", list(ROTATING_CASES))
def test_rotating_cache_with_sink_tokens_returns_identical_keys(case: str, keep: int) -> None:
    """Drive the cache directly (no model): after the handoff, every update must hand the
    attention exactly the same keys and values, in the same order, as the original."""
    length, steps = ROTATING_CASES[case]
    rng = np.random.default_rng(3)

    def kv(n: int) -> tuple[mx.array, mx.array]:
        k = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        return k, mx.array(rng.standard_normal((1, 2, n, 4)).astype(np.float32))  # MLA-like

    original = C.RotatingKVCache(max_size=16, keep=keep)
    original.update_and_fetch(*kv(length - 1))
    for _ in range(steps):
        original.update_and_fetch(*kv(1))
    restored = _roundtrip([original]).caches[0]
    for n in [1] * 20 + [5, 1, 1]:
        new = kv(n)
        for a, b in zip(original.update_and_fetch(*new), restored.update_and_fetch(*new), strict=True):
            assert np.array_equal(_bits(a), _bits(b))
        assert (original.offset, original._idx) == (restored.offset, restored._idx)


def test_whole_prompt_rotating_cache_travels_cut_to_the_window() -> None:
    model = _model("gemma3_text", "bfloat16")
    original = _prefill(model, _prompt(257))
    assert original[0].state[0].shape[2] == 256  # the rotating layer holds the whole prompt
    frames = encode_cache(original, fingerprint=FP, token_count=256)
    # rotating layer: 16 tokens; global layer: 256 tokens -> (16 + 256) / (256 + 256)
    assert encoded_size(frames) < 0.55 * (original[0].nbytes + original[1].nbytes)
    assert raw_tensor_bytes(original) == 2 * 1 * 32 * 2 * (16 + 256)


def test_kv_cache_state_is_not_cut_and_the_wire_cuts_it() -> None:
    model = _model("llama", "float32")
    original = _prefill(model, _prompt(34))
    keys, _, offset = original[0].state
    assert (keys.shape[2], offset) == (256, 33)  # mlx-lm 0.32.2 hands out the whole buffer
    header = json.loads(_split(b"".join(encode_cache(original, fingerprint=FP, token_count=33)))[0])
    shapes = [item["shape"] for item in header["layers"][0]["state"]["items"][:2]]
    assert shapes == [[1, 1, 33, 32], [1, 1, 33, 32]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wire_size_at_2100_tokens_is_within_one_percent_of_live_tensors(dtype: str) -> None:
    model = _model("llama", dtype)
    prompt = _prompt(2101)
    original = _prefill(model, prompt)
    frames = encode_cache(original, fingerprint=FP, token_count=2100)
    raw = raw_tensor_bytes(original)
    assert raw == 2 * 2 * 1 * 2100 * 32 * DTYPES[dtype].size
    assert encoded_size(frames) <= 1.01 * raw
    assert len(frames) == 2 + -(-raw // (1 << 20))  # header, 1 MiB chunks, end
    decoded = decode_cache(b"".join(frames), fingerprint=FP)
    _assert_same_continuation(model, original, decoded.caches, prompt[-1:], steps=2)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_strided_and_fragmented_arrays_travel_exactly(dtype: str) -> None:
    rng = np.random.default_rng(5)
    kv = C.KVCache()
    big = mx.array(rng.standard_normal((2, 3, 300, 64)).astype(np.float32)).astype(DTYPES[dtype])
    kv.update_and_fetch(big, big[..., :48])  # live view: 6 strided blocks of 300 x 64
    arrays = C.ArraysCache(3)
    arrays[0] = mx.transpose(big, (3, 1, 0, 2))  # fragmented: compacted before sending
    arrays[1] = mx.array(7, dtype=mx.int32)
    restored = _roundtrip([kv, arrays], chunk_bytes=999).caches
    assert restored[1][2] is None
    for a, b in [
        (kv.keys[..., :300, :], restored[0].keys),
        (kv.values[..., :300, :], restored[0].values),
        (arrays[0], restored[1][0]),
        (arrays[1], restored[1][1]),
    ]:
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert np.array_equal(_bits(mx.contiguous(a)), _bits(b))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_streamed_piece_is_framed_as_its_layers_would_be(dtype: str) -> None:
    """A streamed prefill's piece (wire views of plain KVCache layers, read without evaluating
    anything) has the very header and bytes `host_tensors` gives those layers."""
    rng = np.random.default_rng(9)
    layers = []
    for _ in range(3):
        buffer = mx.array(rng.standard_normal((1, 2, 40, 16)).astype(np.float32)).astype(DTYPES[dtype])
        layers.append((mx.contiguous(buffer[..., 8:29, :]), mx.contiguous(buffer[..., 11:32, :] * 2)))
    caches = [C.KVCache.from_state((keys, values, 21)) for keys, values in layers]
    views = [wire_view(array) for pair in layers for array in pair]
    mx.eval(views)
    piece = kv_piece_tensors(views, dtype=DTYPES[dtype], fingerprint=FP, token_count=21)
    whole = host_tensors(caches, fingerprint=FP, token_count=21)
    assert piece.header_bytes == whole.header_bytes
    assert piece.version == whole.version
    assert b"".join(bytes(run) for run in piece.runs) == b"".join(bytes(run) for run in whole.runs)
    restored = decode_cache(b"".join(frame_payload(piece)), fingerprint=FP).caches
    for (keys, values), cache in zip(layers, restored, strict=True):
        assert np.array_equal(_bits(keys), _bits(cache.keys))
        assert np.array_equal(_bits(values), _bits(cache.values))


def test_chunk_size_does_not_change_the_decoded_cache() -> None:
    model = _model("falcon_h1", "bfloat16")
    prompt = _prompt(40)
    original = _prefill(model, prompt)
    small = encode_cache(original, fingerprint=FP, token_count=39, chunk_bytes=1000)
    big = encode_cache(original, fingerprint=FP, token_count=39)
    assert len(small) > len(big) == 3
    assert all(len(f) == 5 + 1000 for f in small[1:-2])
    decoded = decode_cache(b"".join(small), fingerprint=FP)
    _assert_same_continuation(model, original, decoded.caches, prompt[-1:])


# --------------------------------------------------------------------------- the format itself


def _split(payload: bytes) -> tuple[bytes, bytes]:
    """(header JSON, concatenated tensor bytes), read independently of the codec."""
    magic, version = struct.unpack_from("<8sH", payload, 0)
    assert magic == MAGIC and version in READ_VERSIONS
    pos, header, data = 10, b"", []
    while True:
        kind, length = struct.unpack_from("<cI", payload, pos)
        body = payload[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if kind == b"H":
            header = body
        elif kind == b"D":
            data.append(body)
        else:
            assert kind == b"E" and pos == len(payload)
            total, crc = struct.unpack("<QI", body)
            joined = b"".join(data)
            assert total == len(joined) and crc == zlib.crc32(header + joined)
            return header, joined


def _seal(header: bytes, data: bytes, version: int = ALL_HEADS_VERSION) -> bytes:
    """A payload written from the spec in docs/wire-format.md, with a valid checksum."""
    return b"".join(
        [
            struct.pack("<8sH", MAGIC, version),
            struct.pack("<cI", b"H", len(header)),
            header,
            struct.pack("<cI", b"D", len(data)) if data else b"",
            data,
            struct.pack("<cI", b"E", 12),
            struct.pack("<QI", len(data), zlib.crc32(header + data)),
        ]
    )


@functools.cache
def _sample() -> tuple[list[bytes], int]:
    """A small llama payload cut into several data frames (and its layer count)."""
    cache = _prefill(_model("llama", "float32"), _prompt(9))
    return encode_cache(cache, fingerprint=FP, token_count=8, chunk_bytes=1024), len(cache)


def _payload() -> bytes:
    return b"".join(_sample()[0])


def _header() -> dict[str, Any]:
    header: dict[str, Any] = json.loads(_split(_payload())[0])
    return header


def _code(payload: bytes, **kw: Any) -> Code:
    kw.setdefault("fingerprint", FP)
    with pytest.raises(StatecoreError) as info:
        decode_cache(payload, **kw)
    return info.value.info.code


def test_the_format_matches_its_spec() -> None:
    frames, _ = _sample()
    payload = b"".join(frames)
    header, data = _split(payload)
    assert frames[0] == struct.pack("<8sH", MAGIC, 1) + struct.pack("<cI", b"H", len(header)) + (header)
    assert json.loads(header)["fingerprint"] == FP
    assert json.loads(header)["token_count"] == 8
    assert len(data) == 2 * 2 * 8 * 32 * 4
    assert encoded_size(frames) == len(payload)
    assert decode_cache(_seal(header, data), fingerprint=FP).token_count == 8


def test_flipped_tensor_byte_is_a_checksum_error() -> None:
    payload = bytearray(_payload())
    payload[len(_sample()[0][0]) + 5 + 17] ^= 0x01
    assert _code(bytes(payload)) is Code.KV_CHECKSUM


def test_flipped_header_byte_is_a_checksum_error() -> None:
    payload = _payload()
    at = payload.index(b'"token_count":8') + len('"token_count":')
    assert _code(payload[:at] + b"9" + payload[at + 1 :]) is Code.KV_CHECKSUM


def test_truncations_are_reported_as_truncated() -> None:
    frames, _ = _sample()
    payload = b"".join(frames)
    head = len(frames[0])
    cuts = {
        "empty": 0,
        "in the magic": 3,
        "in the version": 9,
        "in the header frame": head - 10,
        "after the header": head,
        "mid-body": head + 700,
        "at a data frame boundary": head + len(frames[1]),
        "before the end frame": len(payload) - len(frames[-1]),
        "in the end frame": len(payload) - 3,
    }
    for where, cut in cuts.items():
        assert _code(payload[:cut]) is Code.KV_TRUNCATED, where
    dropped = b"".join(frames[:1] + frames[2:])  # a whole data frame lost, end frame kept
    assert _code(dropped) is Code.KV_TRUNCATED


def test_wrong_fingerprint_is_wrong_model() -> None:
    assert _code(_payload(), fingerprint="another-model") is Code.KV_WRONG_MODEL


def test_wrong_layer_count_or_classes_is_wrong_model() -> None:
    _, layers = _sample()
    assert _code(_payload(), expected_classes=["KVCache"] * (layers + 1)) is Code.KV_WRONG_MODEL
    wrong = ["KVCache"] * (layers - 1) + ["RotatingKVCache"]
    assert _code(_payload(), expected_classes=wrong) is Code.KV_WRONG_MODEL
    ok = decode_cache(_payload(), fingerprint=FP, expected_classes=["KVCache"] * layers)
    assert ok.class_names == ("KVCache",) * layers


def test_oversize_is_too_large() -> None:
    payload = _payload()
    assert _code(payload, max_bytes=len(payload) - 1) is Code.KV_TOO_LARGE
    assert decode_cache(payload, fingerprint=FP, max_bytes=len(payload)).token_count == 8


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00" * 64,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b'{"layers": []}',
        MAGIC[:4] + b"\xff" * 40,
    ],
)
def test_garbage_is_malformed(payload: bytes) -> None:
    assert _code(payload) is Code.KV_MALFORMED


def test_framing_errors_are_malformed() -> None:
    frames, _ = _sample()
    payload = b"".join(frames)
    header, data = _split(payload)
    assert _code(payload + b"\x00") is Code.KV_MALFORMED  # trailing garbage
    assert _code(_seal(header, data, version=FORMAT_VERSION + 1)) is Code.KV_MALFORMED
    swapped = bytearray(payload)
    swapped[len(frames[0])] = ord("X")  # unknown frame type
    assert _code(bytes(swapped)) is Code.KV_MALFORMED
    no_header = payload[:10] + b"".join(frames[1:])
    assert _code(no_header) is Code.KV_MALFORMED
    extra = b"".join(frames[:-1]) + struct.pack("<cI", b"D", 4) + b"\x00" * 4 + frames[-1]
    assert _code(extra) is Code.KV_MALFORMED  # more data than the end frame declares


def _resealed(mutate: Callable[[dict[str, Any]], Any]) -> bytes:
    header, data = _split(_payload())
    doc = json.loads(header)
    mutate(doc)
    return _seal(json.dumps(doc).encode(), data)


_HUGE_EMPTY = {"kind": "array", "dtype": "float32", "shape": [0] + [(1 << 31) - 1] * 3, "nbytes": 0}


def _first_array(doc: dict[str, Any]) -> dict[str, Any]:
    node: dict[str, Any] = doc["layers"][0]["state"]["items"][0]
    return node


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda d: d.update(layers=[]), Code.KV_MALFORMED),
        (lambda d: d.update(token_count=-1), Code.KV_MALFORMED),
        (lambda d: d.update(token_count="8"), Code.KV_MALFORMED),
        (lambda d: d.update(token_count=8.0), Code.KV_MALFORMED),
        (lambda d: d.update(extra=1), Code.KV_MALFORMED),
        (lambda d: d["layers"][0].update(class_name="MyOwnCache"), Code.UNSUPPORTED_CACHE),
        (lambda d: d["layers"][0].update(class_name="deque"), Code.UNSUPPORTED_CACHE),
        (lambda d: d["layers"][0].update(class_name="_BaseCache"), Code.UNSUPPORTED_CACHE),
        (lambda d: d["layers"][0].update(class_name="../etc"), Code.KV_MALFORMED),
        (lambda d: _first_array(d).update(nbytes=1), Code.KV_MALFORMED),
        (lambda d: _first_array(d).update(dtype="float128"), Code.KV_MALFORMED),
        (lambda d: _first_array(d).update(dtype="float16"), Code.KV_MALFORMED),
        (lambda d: _first_array(d).update(shape=[1, 1, 8, 16], nbytes=512), Code.KV_MALFORMED),
        (lambda d: _first_array(d).update(shape=[-1, 1, 8, 32]), Code.KV_MALFORMED),
        (lambda d: _first_array(d).update(shape=[1 << 31, 0], nbytes=0), Code.KV_MALFORMED),
        (lambda d: d["layers"][0]["state"]["items"].append(_HUGE_EMPTY), Code.KV_MALFORMED),
        (lambda d: d["layers"][0]["state"]["items"].pop(), Code.KV_MALFORMED),  # arity
        (lambda d: d["layers"][0]["state"].update(kind="list"), Code.KV_MALFORMED),
        (lambda d: d["layers"][0]["state"].update(kind="dict"), Code.KV_MALFORMED),
        (lambda d: d["layers"][1].update(d["layers"][0]) or d["layers"].pop(), Code.KV_MALFORMED),
    ],
)
def test_well_sealed_but_invalid_headers_are_rejected(
    mutate: Callable[[dict[str, Any]], Any], code: Code
) -> None:
    assert _code(_resealed(mutate)) is code


def test_cache_list_with_unknown_member_name_is_rejected() -> None:
    cache = _prefill(_model("falcon_h1", "float32"), _prompt(5))
    header, data = _split(b"".join(encode_cache(cache, fingerprint=FP, token_count=4)))
    doc = json.loads(header)
    member = doc["layers"][0]["state"]["items"][0]["items"][1]
    assert member == {"kind": "str", "value": "ArraysCache"}
    for name in ("NoSuchCache", "mx", "tree_map"):
        member["value"] = name
        assert _code(_seal(json.dumps(doc).encode(), data)) is Code.KV_MALFORMED


def test_decode_accepts_bytearray_and_memoryview() -> None:
    payload = _payload()
    assert decode_cache(bytearray(payload), fingerprint=FP).token_count == 8
    assert decode_cache(memoryview(payload), fingerprint=FP).token_count == 8


KV_DAMAGE_CODES = {Code.KV_CHECKSUM, Code.KV_TRUNCATED, Code.KV_MALFORMED, Code.KV_WRONG_MODEL}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(1, 255)), max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 1 << 30)),
    tail=st.binary(max_size=8),
)
def test_random_damage_is_always_caught_as_a_typed_kv_error(
    flips: list[tuple[int, int]], cut: int | None, tail: bytes
) -> None:
    original = _payload()
    payload = bytearray(original)
    for at, xor in flips:
        payload[at % len(payload)] ^= xor
    if cut is not None:
        del payload[cut % (len(payload) + 1) :]
    payload += tail
    if bytes(payload) == original:  # flips that cancel out: nothing to catch
        assert decode_cache(bytes(payload), fingerprint=FP).token_count == 8
        return
    assert _code(bytes(payload)) in KV_DAMAGE_CODES


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False)
    | st.sampled_from(["array", "int", "none", "str", "list", "tuple", "KVCache", "float32"])
    | st.text(max_size=4)
    | st.lists(st.sampled_from([0, 1, 2, 8, 32, (1 << 31) - 1, 1 << 31, 1 << 62]), max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["kind", "items", "value", "dtype", "shape", "nbytes", "x"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.lists(st.integers(0, 7), min_size=1, max_size=8), value=_json)
# a KVCache's offset past its arrays: it was decoded, and then could not be sent on
@example(path=[2, 0, 1, 1, 2, 1], value=2**31)
def test_sealed_header_mutations_only_ever_raise_statecore_errors(path: list[int], value: Any) -> None:
    def mutate(doc: dict[str, Any]) -> None:
        node: Any = doc
        for step in path[:-1]:
            children = list(node.values()) if isinstance(node, dict) else node
            if not isinstance(children, list) or not children:
                break
            child = children[step % len(children)]
            if not isinstance(child, dict | list):
                break
            node = child
        if isinstance(node, dict):
            node[sorted(node)[path[-1] % len(node)]] = value
        elif node:
            node[path[-1] % len(node)] = value

    payload = _resealed(mutate)
    try:
        decoded = decode_cache(payload, fingerprint=FP)
    except StatecoreError as exc:
        # A resealed header may also name a class without a codec, or declare too much.
        assert exc.info.code in KV_DAMAGE_CODES | {Code.UNSUPPORTED_CACHE, Code.KV_TOO_LARGE}, exc.info
        return
    # Accepted: then it is a payload in its own right (the mutation left it well-formed, e.g. the
    # same value written back, another token count, or a KVCache offset below its arrays' length,
    # which mlx-lm's caches allow): what was decoded encodes again into a payload that decodes to
    # the same classes and token count.
    again = b"".join(encode_cache(decoded.caches, fingerprint=FP, token_count=decoded.token_count))
    redecoded = decode_cache(again, fingerprint=FP)
    assert (redecoded.class_names, redecoded.token_count) == (decoded.class_names, decoded.token_count)


# --------------------------------------------------------------------------- travel report


class MyCache(mlx_cache._BaseCache):  # a model's own cache class: not in mlx_lm.models.cache
    def __init__(self) -> None:
        self.keys = mx.zeros((1, 1, 4, 8))

    @property
    def state(self) -> Any:
        return (self.keys,)

    @state.setter
    def state(self, v: Any) -> None:
        (self.keys,) = v


# same name as mlx-lm's, but a different class
KVCache: Any = type("KVCache", (mlx_cache.KVCache,), {"__module__": __name__})


def test_travel_report_on_every_family_fresh_and_prefilled() -> None:
    for family in FAMILIES:
        model = _model(family, "float32")
        for cache in (C.make_prompt_cache(model), _prefill(model, _prompt(20))):
            report = travel_report(cache)
            assert [r.index for r in report] == list(range(len(cache)))
            assert [r.class_name for r in report] == [type(c).__name__ for c in cache]
            assert all(r.can_travel and r.reason == "" for r in report), (family, report)


def test_travel_report_empty_is_empty() -> None:
    assert travel_report([]) == ()


def test_foreign_classes_cannot_travel_and_the_reason_names_them() -> None:
    report = travel_report([C.KVCache(), MyCache(), KVCache()])
    assert [r.can_travel for r in report] == [True, False, False]
    assert "MyCache" in report[1].reason
    assert f"{__name__}.KVCache" in report[2].reason


def test_cache_list_with_a_foreign_member_cannot_travel() -> None:
    (layer,) = travel_report([C.CacheList(C.KVCache(), MyCache())])
    assert layer.class_name == "CacheList" and not layer.can_travel
    assert "MyCache" in layer.reason


def test_state_with_unsupported_leaves_cannot_travel() -> None:
    cache = C.KVCache()
    cache.offset = 1.5
    (layer,) = travel_report([cache])
    assert not layer.can_travel and "float" in layer.reason


def test_encode_refuses_what_cannot_travel() -> None:
    for caches in ([], [C.KVCache(), MyCache()]):
        with pytest.raises(StatecoreError) as info:
            encode_cache(caches, fingerprint=FP, token_count=0)
        assert info.value.info.code is Code.UNSUPPORTED_CACHE
    with pytest.raises(StatecoreError) as info:
        encode_cache([C.KVCache()], fingerprint=FP, token_count=-1)
    assert info.value.info.code is Code.INTERNAL


def test_export_pieces_are_the_frames_bytes_without_copying_the_tensors() -> None:
    model = _model("llama", "float32")
    original = _prefill(model, _prompt(300))
    tensors = host_tensors(original, fingerprint=FP, token_count=299)
    in_1mib_frames = [*unsealed_pieces(tensors, chunk_bytes=1 << 20), end_frame(tensors)]
    assert b"".join(in_1mib_frames) == b"".join(frame_payload(tensors))
    pieces = [*unsealed_pieces(tensors), end_frame(tensors)]  # the export's default: large frames
    views = [p for p in pieces if isinstance(p, memoryview)]
    assert sum(v.nbytes for v in views) == raw_tensor_bytes(original)  # every tensor byte, by reference
    assert all(v.obj is not None for v in views)
    decoded = decode_cache(b"".join(pieces), fingerprint=FP)
    _assert_same_continuation(model, original, decoded.caches, _prompt(300)[-1:], steps=2)


def test_the_end_frame_computed_in_the_background_seals_the_unsealed_pieces() -> None:
    model = _model("llama", "float32")
    tensors = host_tensors(_prefill(model, _prompt(100)), fingerprint=FP, token_count=99)
    seal = end_frame_in_background(tensors)
    assert seal() == end_frame(tensors)
    assert len(seal()) == END_FRAME_BYTES  # the result stays available
    broken = end_frame_in_background(HostTensors(b"{}", [memoryview(b"ab"), object()]))  # type: ignore[list-item]
    with pytest.raises(TypeError):
        broken()  # what the thread raised reaches whoever waits for the frame


# --------------------------------------------------------------------------- head ranges (version 2)


def _many_heads(heads: int = 4, tokens: int = 40, layers: int = 2) -> list[Any]:
    """Plain KVCaches of `heads` KV heads, over-allocated buffers (as after a prefill)."""
    mx.random.seed(7)
    caches = []
    for _ in range(layers):
        cache = C.KVCache()
        shape = (1, heads, tokens, 8)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        caches.append(cache)
    return caches


def test_a_payload_of_every_head_stays_version_1_and_names_no_heads() -> None:
    payload = b"".join(encode_cache(_many_heads(), fingerprint=FP, token_count=40))
    assert struct.unpack_from("<8sH", payload) == (MAGIC, ALL_HEADS_VERSION)
    assert all("heads" not in layer for layer in json.loads(_split(payload)[0])["layers"])
    decoded = decode_cache(payload, fingerprint=FP)
    assert decoded.heads == (None, None)


def test_head_range_payloads_round_trip_and_join_to_the_whole() -> None:
    caches = _many_heads()
    whole = decode_cache(b"".join(encode_cache(caches, fingerprint=FP, token_count=40)), fingerprint=FP)
    slices = []
    for start, stop in [(0, 1), (1, 3), (3, 4)]:
        payload = b"".join(encode_cache(caches, fingerprint=FP, token_count=40, heads=(start, stop),
                                        chunk_bytes=1000))
        assert struct.unpack_from("<8sH", payload) == (MAGIC, FORMAT_VERSION)
        layers = json.loads(_split(payload)[0])["layers"]
        assert [layer["heads"] for layer in layers] == [{"start": start, "stop": stop, "total": 4}] * 2
        decoded = decode_cache(payload, fingerprint=FP, expected_classes=["KVCache", "KVCache"])
        assert [(h.start, h.stop, h.total) for h in decoded.heads if h] == [(start, stop, 4)] * 2
        assert decoded.caches[0].keys.shape == (1, stop - start, 40, 8)  # only the live tokens
        slices.append(decoded.caches)
    for index, layer in enumerate(whole.caches):
        for part in ("keys", "values"):
            joined = mx.concatenate([getattr(s[index], part) for s in slices], axis=1)
            assert np.array_equal(_bits(joined), _bits(getattr(layer, part)))
            assert all(s[index].offset == layer.offset for s in slices)


def test_an_old_reader_refuses_a_head_range_payload_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = b"".join(encode_cache(_many_heads(), fingerprint=FP, token_count=40, heads=(0, 2)))
    monkeypatch.setattr(frames, "READ_VERSIONS", (ALL_HEADS_VERSION,))  # a version-1 node
    with pytest.raises(StatecoreError) as info:
        decode_cache(payload, fingerprint=FP)
    assert info.value.info.code is Code.KV_MALFORMED
    assert "unsupported KV format version 2 (this node reads versions 1)" in info.value.info.message
    one_rank = b"".join(encode_cache(_many_heads(), fingerprint=FP, token_count=40))
    assert decode_cache(one_rank, fingerprint=FP).token_count == 40  # it still reads one-rank payloads


def _heads_doc() -> tuple[dict[str, Any], bytes]:
    header, data = _split(b"".join(encode_cache(_many_heads(), fingerprint=FP, token_count=40,
                                                heads=(0, 2))))
    return json.loads(header), data


@pytest.mark.parametrize(
    ("mutate", "version"),
    [
        (lambda d: None, ALL_HEADS_VERSION),  # head ranges in a version-1 payload
        (lambda d: d["layers"][0]["heads"].update(stop=3), FORMAT_VERSION),  # not what the arrays hold
        (lambda d: d["layers"][0]["heads"].update(start=2, stop=2), FORMAT_VERSION),
        (lambda d: d["layers"][0]["heads"].update(total=1), FORMAT_VERSION),
        (lambda d: d["layers"][0]["heads"].update(start=-1), FORMAT_VERSION),
        (lambda d: d["layers"][0]["heads"].update(extra=1), FORMAT_VERSION),
        (lambda d: d["layers"][0].update(class_name="ChunkedKVCache"), FORMAT_VERSION),
    ],
)
def test_invalid_head_ranges_are_malformed(mutate: Callable[[dict[str, Any]], Any], version: int) -> None:
    doc, data = _heads_doc()
    mutate(doc)
    assert _code(_seal(json.dumps(doc).encode(), data, version=version)) is Code.KV_MALFORMED


def test_head_ranges_cut_plain_kv_caches_only() -> None:
    with pytest.raises(StatecoreError) as info:
        encode_cache([C.RotatingKVCache(max_size=8)], fingerprint=FP, token_count=0, heads=(0, 1))
    assert info.value.info.code is Code.UNSUPPORTED_CACHE
    with pytest.raises(StatecoreError) as info:
        encode_cache(_many_heads(), fingerprint=FP, token_count=40, heads=(2, 5))
    assert info.value.info.code is Code.INTERNAL
