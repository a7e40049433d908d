"""The plans rank 0 of a tensor-parallel instance broadcasts: every command survives its bytes."""

from __future__ import annotations

import pytest

from adapters.mlx import lockstep
from effects.engine_port import SamplingParams

SAMPLING = SamplingParams(max_tokens=9, temperature=0.7, seed=3, xtc_special_tokens=(1, 2),
                          logit_bias=((5, -1.5), (7, 2.0)), logprobs=2,
                          response_format='{"type":"json_object"}')
EVERY_KIND = lockstep.Plan((
    lockstep.Load({"max_batch": 4, "kv_bits": None}),
    lockstep.Prefill("r1", (1, 2, 3), SAMPLING),
    lockstep.Decode("r1", (1, 2, 3), 4, SAMPLING),
    lockstep.Decode("r2", (5,), 6, SamplingParams(max_tokens=2), sliced=True),
    lockstep.Drop("r1"), lockstep.Release("r2"), lockstep.Export("r3"), lockstep.ForgetPrefixes(),
    lockstep.Stop(),
))


def test_every_command_survives_its_bytes() -> None:
    assert lockstep.decode_plan(lockstep.encode_plan(EVERY_KIND)) == EVERY_KIND


def test_an_empty_plan_is_no_bytes() -> None:
    assert lockstep.encode_plan(lockstep.Plan()) == b""
    assert lockstep.decode_plan(b"") == lockstep.Plan()


@pytest.mark.parametrize("damage", [
    lambda data: b"XXXX" + data[4:],  # not a plan
    lambda data: data[:4] + b"\x09" + data[5:],  # another version
    lambda data: data + b"!",  # trailing bytes
    lambda data: data[:6],  # shorter than its preamble
])
def test_damaged_plans_are_refused(damage: object) -> None:
    data = lockstep.encode_plan(EVERY_KIND)
    with pytest.raises(ValueError):
        lockstep.decode_plan(damage(data))  # type: ignore[operator]
