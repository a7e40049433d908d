"""The plans rank 0 of a tensor-parallel instance broadcasts: every replicated command survives its
bytes; what undoes a command whose caller left."""

from __future__ import annotations

import pytest

from adapters.mlx import commands, lockstep
from effects.engine_port import SamplingParams

SAMPLING = SamplingParams(max_tokens=9, temperature=0.7, seed=3, xtc_special_tokens=(1, 2),
                          logit_bias=((5, -1.5), (7, 2.0)), logprobs=2,
                          response_format='{"type":"json_object"}')
EVERY_KIND = lockstep.Plan((
    commands.Load({"max_batch": 4, "kv_bits": None}),
    commands.Prefill("r1", (1, 2, 3), SAMPLING),
    commands.DecodeHeld("r1", (1, 2, 3), 4, SAMPLING),
    commands.Install("r2", (5,), 6, SamplingParams(max_tokens=2), sliced=True),
    commands.Install("r3", (5, 6), 7, SAMPLING),
    commands.Cancel("r1"), commands.Release("r2"), commands.Export("r3"), commands.ForgetPrefixes(),
    commands.Stop(),
))


def test_every_command_survives_its_bytes() -> None:
    assert lockstep.decode_plan(lockstep.encode_plan(EVERY_KIND)) == EVERY_KIND


def test_every_replicated_kind_is_in_the_plan_above() -> None:
    assert {type(command) for command in EVERY_KIND.commands} == set(commands.REPLICATED)


def test_a_prefill_or_a_join_is_undone_by_a_cancel_and_nothing_else_needs_undoing() -> None:
    assert [commands.undo_of(command) for command in EVERY_KIND.commands] == [
        None, commands.Cancel("r1"), commands.Cancel("r1"), commands.Cancel("r2"), commands.Cancel("r3"),
        None, None, None, None, None]


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
