"""KV payloads as this node takes them: validated against its model (the fingerprint, every
layer's cache class, the tokens covered, the heads carried) and built into caches.

`validate_and_build` (a whole handed-off cache, or a tensor-parallel rank's head slice),
`validate_segment` (one streamed piece) and `validate_prefix` (another node's prefix-cache blocks)
run in a worker thread (nothing lazy: no device stream is involved); `joined_segments` joins a
streamed handoff's pieces into one cache per layer on the device thread. A payload that is not
what it claims fails with the peer's fault (`KV_MALFORMED`, `KV_TRUNCATED`). This module imports
mlx and mlx-lm; it must never import trio.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from adapters.kv import codec
from adapters.mlx import managed_memory
from adapters.mlx.distributed import rank_heads
from effects.engine_port import KvBytes, KvSegment
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = ["joined_segments", "kv_cache", "validate_and_build", "validate_prefix", "validate_segment"]


def kv_cache(keys: Any, values: Any, tokens: int) -> Any:
    """A plain KVCache over these arrays, holding `tokens` positions."""
    return KVCache.from_state((keys, values, tokens))  # type: ignore[no-untyped-call]


def _built(validated: Any) -> list[Any]:
    """A checked payload's caches, their memory on the device already where it is the host's until
    the device reads it (`managed_memory.to_device`: here, in the worker thread that built them,
    rather than by faults on the step that reads them)."""
    built: list[Any] = codec.build_caches(validated).caches
    if managed_memory.enabled():  # (a cache's `state` may build new arrays: not when nothing moves)
        managed_memory.to_device([array for cache in built for array in _arrays(cache)])
    return built


def _arrays(cache: Any) -> list[Any]:
    """A built cache's buffers: a KV cache's keys and values as they are held (its `state` would
    be new, lazy slices of them), else its state's arrays."""
    from mlx.utils import tree_flatten

    held = [getattr(cache, "keys", None), getattr(cache, "values", None)]
    if all(isinstance(array, mx.array) for array in held):
        return held
    return [item[1] for item in tree_flatten(cache.state) if isinstance(item[1], mx.array)]


def _malformed(message: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, message))


def validate_and_build(payload: KvBytes, prompt_tokens: int, *, fingerprint: str, classes: Sequence[str],
                       heads: tuple[int, int] | None = None) -> list[Any]:
    """The caches of a payload for this node: every head (`heads` None), or the KV heads
    (rank, size) of a tensor-parallel rank's slice, each layer's header naming that range."""
    validated = codec.validate_payload(payload, fingerprint=fingerprint, expected_classes=list(classes))
    if validated.header.token_count != prompt_tokens:
        raise _malformed(f"the KV payload covers {validated.header.token_count} tokens, "
                         f"the prompt has {prompt_tokens}")
    for index, layer in enumerate(validated.header.layers):
        got = layer.heads
        if got is None:
            if heads is None:
                continue
            held, want = "every head", f"its slice of rank {heads[0]} of {heads[1]}"
        else:
            need = (0, got.total) if heads is None else rank_heads(*heads, got.total)
            if (got.start, got.stop) == need:
                continue
            held, want = f"heads [{got.start}, {got.stop}) of {got.total}", f"heads {list(need)}"
        raise _malformed(f"layer {index} of the KV payload holds {held}, this node needs {want}")
    return _built(validated)


def validate_segment(segment: KvSegment, prompt_tokens: int, *, fingerprint: str, classes: Sequence[str],
                     streams_ranges: bool) -> list[Any]:
    """A streamed piece's caches: a whole payload of its layers' classes, over its tokens
    (`classes`: every layer's; `streams_ranges`: whether this model's cache may come in token
    ranges)."""
    payload = segment.payload.joined() if len(segment.payload.pieces) != 1 else segment.payload.pieces[0]
    whole = segment.start == 0 and segment.stop == prompt_tokens
    if not whole and not streams_ranges:
        raise _malformed("this model's cache travels whole, not in token ranges")
    mine = list(classes[segment.first_layer : segment.end_layer])
    validated = codec.validate_payload(payload, fingerprint=fingerprint, expected_classes=mine)
    if validated.header.token_count != segment.stop - segment.start:
        raise _malformed(f"a KV segment of tokens [{segment.start}, {segment.stop}) holds "
                         f"{validated.header.token_count}")
    if any(layer.heads is not None for layer in validated.header.layers):
        raise _malformed("a KV segment names a head range: a piece carries every head")
    return _built(validated)


def validate_prefix(payload: KvBytes, most_tokens: int, *, fingerprint: str, classes: Sequence[str],
                    bounds: Collection[int]) -> tuple[int, list[Any]]:
    """Another node's prefix-cache blocks: (the tokens they cover, their caches). They must cover
    whole blocks of the `most_tokens` asked for (end where one of them ends: `bounds`,
    `statecore.prefix.conversation_block_bounds`), every head of every layer."""
    validated = codec.validate_payload(payload, fingerprint=fingerprint, expected_classes=list(classes))
    count = validated.header.token_count
    if not 0 < count <= most_tokens or count not in bounds:
        raise _malformed(f"a prefix payload must cover whole blocks of the {most_tokens} tokens "
                         f"asked for; it covers {count}")
    if any(layer.heads is not None for layer in validated.header.layers):
        raise _malformed("a prefix payload carries every head of every layer")
    return count, _built(validated)


def joined_segments(tokens: int, pieces: list[tuple[int, int, int, list[Any]]], layers: int) -> list[Any]:
    """On the device thread: a streamed handoff's pieces (first layer, end layer, first token,
    caches) as one cache per layer of `tokens` positions (each layer's token ranges in order: the
    reader checked they follow one another)."""
    if len(pieces) == 1 and pieces[0][:2] == (0, layers):
        return pieces[0][3]
    keys: list[list[Any]] = [[] for _ in range(layers)]
    values: list[list[Any]] = [[] for _ in range(layers)]
    for first_layer, end_layer, _, built in pieces:
        for index, cache in zip(range(first_layer, end_layer), built, strict=True):
            keys[index].append(cache.keys)
            values[index].append(cache.values)
    if any(sum(int(k.shape[2]) for k in layer) != tokens for layer in keys):
        raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_TRUNCATED,
                                       f"the KV segments do not cover the prompt's {tokens} tokens"))
    return [kv_cache(k[0] if len(k) == 1 else mx.concatenate(k, axis=2),
                     v[0] if len(v) == 1 else mx.concatenate(v, axis=2), tokens)
            for k, v in zip(keys, values, strict=True)]
