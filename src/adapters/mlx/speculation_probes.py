"""The load check of speculative decoding (`load_check`, which `Speculator.measure` runs): whether
speculation can be exact on this device and BLAS, and how many drafts a verify step may carry. Its
probes: a short prompt's cache, and the model's calls on it computed two ways that must
agree to the bit before speculation serves: an ordinary step at each row count (which counts
compute a row alike), a verify step against the same tokens fed one step at a time, and the
prompt's last call carrying drafts against the last token alone and single steps after it. Each
runs on a small pool laid out as the node's, never the node's own. This module imports mlx and
mlx_lm; never trio, never the device loop (seen as a `LaneHost`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from adapters.mlx.rows import LaneHost
from adapters.mlx.sampling import log_softmax
from adapters.mlx.slots import SlotPool
from statecore.speculation import draft_room, row_classes

if TYPE_CHECKING:
    from adapters.mlx.draft_model import DraftModel

__all__ = ["PROBE_STAGE", "PROBE_TOKENS", "LoadCheck", "last_call_equals_today", "load_check",
           "probe_prompt", "probe_row", "verify_equals_single_steps"]

logger = logging.getLogger("adapters.engine_mlx")

PROBE_STAGE = "speculation_check"  # the stage the test hook sees in the load check's model calls
PROBE_TOKENS = 24  # the probe prompt: a few positions, so attention reads real keys
_EXTRA_COUNTS = 8  # row counts measured past the largest verify step (a row in a higher slot)


@dataclass(frozen=True, slots=True)
class LoadCheck:
    """What the load check found: the row counts computing a row alike (`row_classes`), the drafts
    a prompt's last call may carry (0: the last token goes alone), or why speculation is off."""

    classes: tuple[int, ...] = ()
    first_room: int = 0
    off_reason: str | None = None


def load_check(loop: LaneHost, pipelined: bool, mode: str, max_rows: int, num_draft_tokens: int,
               draft: DraftModel | None) -> LoadCheck:
    """Which row counts compute a row alike on this device and BLAS, and whether a verify step
    then equals single steps (else, or where the node cannot speculate at all, `pipelined` for a
    pipeline- or tensor-parallel instance, the reason it is off, logged). A check that raises (a
    kernel this device cannot launch for a verify row's shapes, or the draft model's) turns
    speculation off: the node serves without it rather than not at all."""
    pool = loop.pool
    off: str | None = None
    if pool is None:
        off = "the model decodes outside the slot layout (speculation runs in it only)"
    elif loop.compiled is not None:
        off = ("the traced decode step (--compile-decode) computes other bits than a verify step; "
               "speculation needs --compile-decode off")
    elif pipelined:
        off = "pipeline- and tensor-parallel instances do not speculate"
    if off is not None or pool is None:
        return _off(off or "")
    most = min(pool.num_slots, max_rows * (num_draft_tokens + 1) + _EXTRA_COUNTS)
    loop.computing = (PROBE_STAGE, ())
    try:
        with mx.stream(generation_stream):
            if draft is not None:
                draft.check()
            cache, last = probe_prompt(loop.model)
            rows = [probe_row(loop, pool, cache, last, count) for count in range(1, most + 1)]
            equal = [[bool(mx.array_equal(a, b).item()) for b in rows] for a in rows]
            classes = row_classes(equal)
            room = draft_room(classes, 1, 1, num_draft_tokens)
            exact = room == 0 or verify_equals_single_steps(loop, pool, cache, last, room)
            first_exact = exact and room > 0 and last_call_equals_today(loop, pool, room)
    except Exception as exc:
        what = "a verify step" if draft is None else "a verify step or the draft model"
        return _off(f"the load check raised {type(exc).__name__}: {exc} (this device cannot compute "
                    f"{what} for this model)")
    finally:
        loop.computing = ("", ())
    if not exact:
        return _off("a verify step's rows differ from single steps on this device (load check)")
    if draft_room(classes, 1, 1, 1) == 0:
        return _off("on this device and BLAS a step of two rows computes a lone row's numbers "
                    "differently, so no verify step could be exact")
    logger.info("speculative decoding (%s): a lone row's verify step carries up to %d draft "
                "tokens (row counts computing alike: %s)", mode, room, classes)
    if not first_exact:
        logger.warning("a prompt's last call computes its rows differently with drafts on this "
                       "device (load check): the last token goes alone, the first verify step after it")
    return LoadCheck(classes, room if first_exact else 0)


def _off(reason: str) -> LoadCheck:
    logger.warning("speculative decoding is off: %s", reason)
    return LoadCheck(off_reason=reason)


def last_call_equals_today(loop: LaneHost, pool: SlotPool, drafts: int) -> bool:
    """The probe prompt's last token and `drafts` drafts in one call on its prompt cache against
    today's calls (the last token alone on that cache, then each draft as a lone row's slot step):
    every row's log-probabilities, the last token's keys and values, and a slot step after them
    (reading the keys the call wrote) equal, bit for bit."""
    fed = [1 + (11 * i) % 89 for i in range(drafts)]
    after = 5
    alone, last = probe_prompt(loop.model)
    expected = [log_softmax(loop.model(mx.array([[last]]), cache=alone)[:, -1, :])[0]]
    single = _fresh_pool(loop, pool, 1, alone, PROBE_TOKENS)
    for i, token in enumerate([*fed, after]):
        layers = single.step_layers([PROBE_TOKENS + i], bucket=loop.bucket)
        logits = loop.model(mx.array([token], dtype=mx.uint32)[:, None], cache=layers)[:, -1, :]
        expected.append(log_softmax(logits)[0])
        mx.eval(expected[-1], single.keys, single.values)
    carried, _ = probe_prompt(loop.model)
    got = log_softmax(loop.model(mx.array([[last, *fed]]), cache=carried)[0])
    mx.eval(got, [layer.state for layer in carried])
    prompt = slice(0, PROBE_TOKENS)
    kv_alike = all(bool(mx.array_equal(a.keys[..., prompt, :], b.keys[..., prompt, :]).item())
                   and bool(mx.array_equal(a.values[..., prompt, :], b.values[..., prompt, :]).item())
                   for a, b in zip(alone, carried, strict=True))
    then = _fresh_pool(loop, pool, 1, carried, PROBE_TOKENS + drafts)
    layers = then.step_layers([PROBE_TOKENS + drafts], bucket=loop.bucket)
    next_row = log_softmax(loop.model(mx.array([after], dtype=mx.uint32)[:, None], cache=layers)[:, -1, :])[0]
    mx.eval(next_row)
    rows = [*(got[i] for i in range(drafts + 1)), next_row]
    return kv_alike and all(bool(mx.array_equal(a, b).item()) for a, b in zip(rows, expected, strict=True))


def probe_prompt(model: Any) -> tuple[list[Any], int]:
    """A short prompt's cache (all but its last token) and that last token."""
    tokens = [1 + (7 * i) % 97 for i in range(PROBE_TOKENS)]
    cache: list[Any] = make_prompt_cache(model)
    model(mx.array([tokens[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache, tokens[-1]


def _fresh_pool(loop: LaneHost, pool: SlotPool, slots: int, cache: list[Any],
                tokens: int = PROBE_TOKENS - 1) -> SlotPool:
    """A small pool laid out as the node's, holding the probe prompt's `tokens` positions in slot 0."""
    room = 2 * PROBE_TOKENS + 2 * slots + max(0, tokens - PROBE_TOKENS + 1)
    probe = SlotPool(slots, pool.num_layers, room)
    probe.attention, probe.exact_rows = pool.attention, pool.exact_rows
    probe.write_prompt(0, cache, tokens)
    return probe


def probe_row(loop: LaneHost, pool: SlotPool, cache: list[Any], last: int, count: int) -> Any:
    """The probe row's log-probabilities from an ordinary step of `count` rows (the others free
    slots' throwaway rows at position 0)."""
    probe = _fresh_pool(loop, pool, count, cache)
    offsets = [PROBE_TOKENS - 1] + [0] * (count - 1)
    inputs = mx.array([last] + [0] * (count - 1), dtype=mx.uint32)
    logits = loop.model(inputs[:, None], cache=probe.step_layers(offsets, bucket=loop.bucket))[:, -1, :]
    row = log_softmax(logits)[0]
    mx.eval(row)
    return row


def verify_equals_single_steps(loop: LaneHost, pool: SlotPool, cache: list[Any], last: int,
                                drafts: int) -> bool:
    """A verify step of a lone row and `drafts` drafts against the same tokens fed one step at a
    time: every row's log-probabilities equal, bit for bit."""
    fed = [last] + [1 + (11 * i) % 89 for i in range(drafts)]
    single = _fresh_pool(loop, pool, 1, cache)
    expected = []
    for i, token in enumerate(fed):
        layers = single.step_layers([PROBE_TOKENS - 1 + i], bucket=loop.bucket)
        logits = loop.model(mx.array([token], dtype=mx.uint32)[:, None], cache=layers)[:, -1, :]
        expected.append(log_softmax(logits)[0])
        mx.eval(expected[-1], single.keys, single.values)
    verify = _fresh_pool(loop, pool, 1, cache)
    offsets = [PROBE_TOKENS - 1 + i for i in range(len(fed))]
    layers = verify.step_layers(offsets, [0] * len(fed), bucket=loop.bucket)
    got = log_softmax(loop.model(mx.array(fed, dtype=mx.uint32)[:, None], cache=layers)[:, -1, :])
    mx.eval(got)
    return all(bool(mx.array_equal(got[i], want).item()) for i, want in enumerate(expected))
