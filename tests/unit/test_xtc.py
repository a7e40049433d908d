"""XTC ("exclude top choices"): when its coin comes up, every token above the threshold but the
least likely of them is left out, never a special token; the coin is keyed by (seed, position)."""

from __future__ import annotations

import math

import mlx.core as mx

from adapters.mlx.sampling import exclude_top_choices, sample
from effects.engine_port import SamplingParams

# Probabilities 0.4, 0.3, 0.2, 0.1 as log-probabilities.
ROW = mx.array([[math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]])


def kept(sampling: SamplingParams, position: int = 0) -> list[bool]:
    out = exclude_top_choices(ROW, sampling, seed=1, position=position)
    return [v > -math.inf for v in out[0].tolist()]


def test_always_on_leaves_out_all_top_choices_but_the_least_likely_of_them() -> None:
    always = SamplingParams(max_tokens=1, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.15)
    assert kept(always) == [False, False, True, True]  # 0.4 and 0.3 go; 0.2 is the last above 0.15
    assert kept(SamplingParams(max_tokens=1, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.35)) == [
        True, True, True, True]  # one token above the threshold: nothing to leave out
    special = SamplingParams(max_tokens=1, temperature=1.0, xtc_probability=1.0, xtc_threshold=0.15,
                             xtc_special_tokens=(0,))
    assert kept(special) == [True, False, True, True]
    # the draw never picks a left-out token
    assert {int(sample(ROW, always, 3, p).item()) for p in range(200)} <= {2, 3}


def test_the_coin_is_keyed_by_seed_and_position() -> None:
    half = SamplingParams(max_tokens=1, temperature=1.0, xtc_probability=0.5, xtc_threshold=0.15)
    firsts = [kept(half, position)[0] for position in range(200)]
    assert firsts == [kept(half, position)[0] for position in range(200)]  # the same each time
    assert 60 < firsts.count(False) < 140  # about half the positions flip the coin
