"""Speculative decoding (`--speculative ngram`, `--draft-model`) against the same engine without
it, on a tiny model that mostly continues a fixed chain of tokens (`support.chain_model`):
prompts holding the chain are drafted from, and a smaller chain model drafts as well; the drafts
mostly stand, and every token must be the one decoding without speculation gives, greedy and
seeded, on one node and after a handoff."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import mlx.core as mx
import pytest
import trio
from mlx_lm.utils import load as mlx_lm_load

from adapters.mlx import MlxEngine
from adapters.mlx.draft_model import DraftModel
from adapters.mlx.sampling import PositionSampler
from adapters.mlx.speculation_probes import PROBE_STAGE
from effects.engine_port import SamplingParams
from statecore.errors import Code, StatecoreError
from statecore.ids import RequestId
from statecore.prefix import prompt_chunks
from support.chain_model import build_chain_checkpoint, chain
from tests.integration.device_faults import FailingAttention
from tests.integration.engines import close_engine, load_engine, sent_tokens, streamed_prefill

GREEDY = SamplingParams(max_tokens=80)
SEEDED = SamplingParams(max_tokens=80, temperature=0.7, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def chain_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chain_checkpoint(tmp_path_factory.mktemp("chain"))


@pytest.fixture
async def engines(chain_dir: Path) -> AsyncIterator[tuple[MlxEngine, MlxEngine]]:
    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    try:
        speculating = await load_engine(chain_dir, prefill_chunk_size=16, speculative="ngram",
                                        num_draft_tokens=4)
        try:
            yield plain, speculating
        finally:
            await close_engine(speculating)
    finally:
        await close_engine(plain)


def edit_like(start: int, salt: int = 0) -> list[int]:
    """A prompt that holds what the model will write: the chain from `start` on, then other
    tokens, then `start` again."""
    filler = [9 + (13 * i + salt) % 400 for i in range(12)]
    return [*filler, *chain(start, 60), *filler[:5], start]


def ends_in_chain(start: int, salt: int = 0) -> list[int]:
    """An edit-like prompt whose last tokens are the chain's first three: prompt lookup drafts the
    answer from the prompt's last call on (the request's first verify step)."""
    return [*edit_like(start, salt)[:-1], *chain(start, 3)]


async def single(engine: MlxEngine, rid: str, prompt: list[int], sampling: SamplingParams) -> list[int]:
    outcome = await engine.prefill(RequestId(rid), prompt, sampling)
    await engine.decode_held(RequestId(rid), prompt, outcome.first_token, sampling)
    return [outcome.first_token] + await sent_tokens(engine.stream(RequestId(rid)))


async def handed_off(prefill: MlxEngine, decode: MlxEngine, rid: str, prompt: list[int],
                     sampling: SamplingParams) -> list[int]:
    outcome = await prefill.prefill(RequestId(rid), prompt, sampling)
    payload = (await prefill.export_held(RequestId(rid))).joined()
    await prefill.release_held(RequestId(rid))
    await decode.install(RequestId(rid), payload, prompt, outcome.first_token, sampling)
    return [outcome.first_token] + await sent_tokens(decode.stream(RequestId(rid)))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_speculating_row_emits_the_tokens_it_emits_without_speculation(
        engines: tuple[MlxEngine, MlxEngine], sampling: SamplingParams) -> None:
    plain, speculating = engines
    # the first: the last token alone, the verify steps after it; the second: the prompt's last
    # call verifies the first drafts
    for n, prompt in enumerate((edit_like(40, 0), ends_in_chain(200, 1))):
        expected = await single(plain, f"p{n}", prompt, sampling)
        assert await single(speculating, f"s{n}", prompt, sampling) == expected
    stats = speculating.statistics()
    assert 0 < stats.speculative_accepted < stats.speculative_drafted  # drafts stood, and some fell
    assert stats.speculative_emitted >= stats.speculative_accepted + stats.speculative_steps
    assert stats.speculative_emitted > 2 * stats.speculative_steps  # several tokens per verify step
    assert plain.statistics().speculative_steps == 0


async def test_with_exact_rows_the_verify_step_s_rows_are_ordinary_steps(chain_dir: Path) -> None:
    """`decode_attention="rows"`: a verify step's rows each attend over exactly their own length,
    as the ordinary steps they stand for; the load check passes and the tokens are the plain
    engine's, greedy and seeded."""
    plain = await load_engine(chain_dir, prefill_chunk_size=16, decode_attention="rows")
    try:
        speculating = await load_engine(chain_dir, prefill_chunk_size=16, speculative="ngram",
                                        num_draft_tokens=4, decode_attention="rows")
        try:
            for sampling in (GREEDY, SEEDED):
                prompt = edit_like(40, 3)
                expected = await single(plain, f"p{sampling.seed}", prompt, sampling)
                assert await single(speculating, f"s{sampling.seed}", prompt, sampling) == expected
            assert speculating.statistics().speculative_accepted > 0
        finally:
            await close_engine(speculating)
    finally:
        await close_engine(plain)


async def test_a_handed_off_request_speculates_on_the_decode_node_with_a_single_node_s_tokens(
        engines: tuple[MlxEngine, MlxEngine]) -> None:
    plain, speculating = engines
    prompt = edit_like(123, 3)
    expected = await single(plain, "p", prompt, GREEDY)
    assert await handed_off(plain, speculating, "h", prompt, GREEDY) == expected
    assert speculating.statistics().speculative_accepted > 0


async def test_rows_beside_others_and_rows_asking_for_logprobs_decode_without_speculation(
        engines: tuple[MlxEngine, MlxEngine]) -> None:
    plain, speculating = engines
    got: dict[str, list[int]] = {}

    async def run(rid: str, start: int) -> None:
        got[rid] = await single(speculating, rid, edit_like(start), GREEDY)

    async with trio.open_nursery() as nursery:
        for n, start in enumerate((50, 60, 70)):
            nursery.start_soon(run, f"b{n}", start)
    for n, start in enumerate((50, 60, 70)):
        assert got[f"b{n}"] == await single(plain, f"p{n}", edit_like(start), GREEDY)
    steps = speculating.statistics().speculative_steps
    with_logprobs = SamplingParams(max_tokens=40, logprobs=2)
    assert await single(speculating, "l", edit_like(80), with_logprobs) == await single(
        plain, "pl", edit_like(80), with_logprobs)
    assert speculating.statistics().speculative_steps == steps


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model without its second layer: the same vocabulary, guesses that mostly stand."""
    return build_chain_checkpoint(tmp_path_factory.mktemp("draft"), num_layers=1)


@pytest.mark.parametrize("take", [3, 2])
def test_drafts_drawn_ahead_are_what_the_row_s_tokens_give(draft_dir: Path, take: int) -> None:
    """Drafts drawn ahead of a verify step that then keeps every draft and draws the guessed
    token are the drafts the row's tokens give a fresh cache (fewer where fewer are asked: the
    cache is cut back to them), and the row's cache then holds what `propose` would have left."""
    model = mlx_lm_load(str(draft_dir))[0]
    prompt = edit_like(60)
    sampler = PositionSampler(GREEDY, 0, len(prompt))
    ahead, fresh = DraftModel(model), DraftModel(model)
    first = ahead.propose("r", prompt, [], 3, sampler)
    ahead.draft_ahead("r", first[-1:], 3, sampler, 3)
    drafts: list[int] = first.tolist()
    ahead.drafted("r", drafts)
    guess = int(ahead.rows["r"].ahead.drawn[0].item())  # type: ignore[union-attr]
    generated = [*drafts, guess]  # every draft stood and the target drew the guess
    taken = ahead.propose("r", prompt, generated, take, sampler).tolist()
    assert (ahead.ahead_taken, ahead.ahead_missed) == (1, 0)
    assert taken == fresh.propose("f", prompt, generated, take, sampler).tolist()
    ahead.drafted("r", taken)
    fresh.drafted("f", taken)
    row, fresh_row = ahead.rows["r"], fresh.rows["f"]
    assert (row.fed, row.guessed) == (fresh_row.fed, fresh_row.guessed)
    assert [layer.offset for layer in row.cache] == [layer.offset for layer in fresh_row.cache]
    # a guess that did not come true: its feeds are cut back, the drafts drawn afresh
    ahead.draft_ahead("r", mx.array(taken[-1:], dtype=mx.uint32), take, sampler, take)
    ahead.drafted("r", taken)
    wrong = [*generated, *taken[:-1], (taken[-1] + 1) % 400 + 9]
    again = ahead.propose("r", prompt, wrong, take, sampler).tolist()
    assert ahead.ahead_missed == 1
    assert again == DraftModel(model).propose("g", prompt, wrong, take, sampler).tolist()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_draft_model_s_guesses_change_no_token(chain_dir: Path, draft_dir: Path,
                                                         sampling: SamplingParams) -> None:
    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    try:
        drafted = await load_engine(chain_dir, prefill_chunk_size=16, draft_model=draft_dir,
                                    num_draft_tokens=3)
        try:
            for n, prompt in enumerate((edit_like(77), [9 + (5 * i) % 300 for i in range(30)])):
                expected = await single(plain, f"p{n}", prompt, sampling)
                assert await single(drafted, f"d{n}", prompt, sampling) == expected
            handed = await handed_off(plain, drafted, "h", edit_like(150, 2), sampling)
            assert handed == await single(plain, "ph", edit_like(150, 2), sampling)
            # prefilled where the prompt's last call drafts: the handoff carries the prompt's cache
            handed = await handed_off(drafted, plain, "h2", edit_like(150, 2), sampling)
            assert handed == await single(plain, "ph2", edit_like(150, 2), sampling)
            stats = drafted.statistics()
            assert 0 < stats.speculative_accepted < stats.speculative_drafted
            draft_model = drafted._device.draft_model
            assert draft_model is not None
            assert not draft_model.rows  # every row's cache let go
            # drafts drawn while verify steps computed: taken where they were guessed right, cut
            # back where a draft fell
            assert draft_model.ahead_taken > 0 and draft_model.ahead_missed > 0
        finally:
            await close_engine(drafted)
    finally:
        await close_engine(plain)


async def test_the_prompt_s_last_call_is_the_first_verify_step(chain_dir: Path) -> None:
    """As mlx-lm's speculative loop: the prompt's last token and the first drafts are one call
    (its row 0 gives the first token), so a request of 1 + num_draft_tokens tokens whose drafts
    all stand is answered by its prefill's calls alone, with the tokens it has without speculation."""
    calls: list[tuple[str, tuple[str, ...]]] = []
    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    speculating = await load_engine(chain_dir, prefill_chunk_size=16, speculative="ngram", num_draft_tokens=4,
                                    model_call_hook=lambda stage, ids: calls.append((stage, tuple(ids))))
    try:
        prompt, sampling = ends_in_chain(40), SamplingParams(max_tokens=5)
        expected = await single(plain, "p", prompt, sampling)
        assert expected == chain(40, 8)[3:]  # what prompt lookup drafts: every draft stands
        assert await single(speculating, "s", prompt, sampling) == expected
        # prompt[:-1] in its chunks, then the last token with the drafts; not one decode step
        assert [stage for stage, ids in calls if "s" in ids] == ["prefill"] * len(prompt_chunks(prompt, 16))
        stats = speculating.statistics()
        assert (stats.speculative_steps, stats.speculative_drafted, stats.speculative_accepted,
                stats.speculative_emitted) == (1, 4, 4, 5)
        assert (stats.decoding, stats.held_caches, stats.kv_reserved_bytes) == (0, 0, 0)
    finally:
        await close_engine(speculating)
        await close_engine(plain)


async def test_a_request_cancelled_between_its_first_verify_step_and_its_decode_leaves_nothing(
        chain_dir: Path, draft_dir: Path) -> None:
    """Its prompt's last call verified drafts (the draft model holds a cache for it, its held cache
    covers the drafts that stood): cancelled then, or handed off and released, nothing of it stays,
    and the next requests decode as without speculation."""
    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    # two rows may speculate: the second prompt's last call drafts beside the first one held
    drafted = await load_engine(chain_dir, prefill_chunk_size=16, draft_model=draft_dir, num_draft_tokens=3,
                                speculative_max_rows=2)
    try:
        prompt = ends_in_chain(90, 4)
        await drafted.prefill(RequestId("c"), prompt, GREEDY)
        await drafted.prefill(RequestId("r"), prompt, GREEDY)
        stats = drafted.statistics()
        assert stats.speculative_steps == 2 and stats.held_caches == 2
        assert set(drafted._device.draft_model.rows) == {"c", "r"}  # type: ignore[union-attr]
        await drafted.cancel(RequestId("c"))
        await drafted.export_held(RequestId("r"))
        await drafted.release_held(RequestId("r"))
        stats = drafted.statistics()
        assert (stats.decoding, stats.held_caches, stats.held_bytes, stats.kv_reserved_bytes) == (0, 0, 0, 0)
        assert not drafted._device.draft_model.rows  # type: ignore[union-attr]
        assert stats.speculative_emitted == 2  # the two first tokens; the drafts that stood never went out
        assert await single(drafted, "d", prompt, GREEDY) == await single(plain, "p", prompt, GREEDY)
    finally:
        await close_engine(drafted)
        await close_engine(plain)


async def test_a_prompt_beside_a_held_one_drafts_nothing_and_both_decode_as_without(
        chain_dir: Path, draft_dir: Path) -> None:
    """A prompt's last call carries drafts only where its request is all the loop knows (one row
    speculates): a second prompt prefilled while the first is held (its first token not yet
    written, or its join not yet asked) goes alone, and both decode the tokens they decode without
    speculation."""
    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    drafted = await load_engine(chain_dir, prefill_chunk_size=16, draft_model=draft_dir, num_draft_tokens=3)
    try:
        prompt = ends_in_chain(90, 4)
        first = await drafted.prefill(RequestId("a"), prompt, GREEDY)
        assert drafted.statistics().speculative_steps == 1  # alone: its last call drafted
        second = await drafted.prefill(RequestId("b"), prompt, GREEDY)
        assert drafted.statistics().speculative_steps == 1  # beside a held one: none
        expected = await single(plain, "p", prompt, GREEDY)
        for rid, outcome in (("a", first), ("b", second)):
            await drafted.decode_held(RequestId(rid), prompt, outcome.first_token, GREEDY)
        for rid, outcome in (("a", first), ("b", second)):
            assert [outcome.first_token, *await sent_tokens(drafted.stream(RequestId(rid)))] == expected
    finally:
        await close_engine(drafted)
        await close_engine(plain)


async def test_a_draft_model_of_another_vocabulary_is_refused(chain_dir: Path, tmp_path: Path) -> None:
    other = build_chain_checkpoint(tmp_path / "other", hidden_size=32, num_layers=1)
    path = other / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # two tokens' ids swapped
    path.write_text(json.dumps(tokenizer))
    with pytest.raises(StatecoreError, match="vocabulary"):
        await load_engine(chain_dir, prefill_chunk_size=16, draft_model=other)


async def test_a_verify_step_that_raises_costs_a_token_s_time_not_the_request(chain_dir: Path) -> None:
    """The first verify step's model call raises (a transient fault): the row decodes that token
    in an ordinary step instead, tries again later, and its answer is unchanged."""
    raised: list[str] = []
    loaded: list[MlxEngine] = []  # the hook runs during the load too

    def hook(stage: str, request_ids: object) -> None:
        speculator = loaded[0]._device.speculator if loaded else None
        if speculator is not None and speculator.verifying and not raised:
            raised.append(stage)
            raise RuntimeError("injected")

    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    speculating = await load_engine(chain_dir, prefill_chunk_size=16, speculative="ngram",
                                    model_call_hook=hook)
    loaded.append(speculating)
    try:
        prompt = edit_like(99, 5)
        assert await single(speculating, "f", prompt, GREEDY) == await single(plain, "p", prompt, GREEDY)
        assert raised == ["decode"] and speculating.statistics().speculative_accepted > 0
    finally:
        await close_engine(speculating)
        await close_engine(plain)


def warnings_about_speculation(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "speculative decoding is off" in r.getMessage()]


async def test_a_load_check_that_fails_on_the_device_leaves_the_node_serving_without_speculation(
        chain_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    stages = [""]

    def hook(stage: str, request_ids: Sequence[str]) -> None:
        stages[0] = stage

    failing = FailingAttention(monkeypatch, lambda: stages[0] == PROBE_STAGE)  # the load check's calls

    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    with caplog.at_level(logging.WARNING, logger="adapters.engine_mlx"):
        speculating = await load_engine(chain_dir, prefill_chunk_size=16, speculative="ngram",
                                        num_draft_tokens=4, model_call_hook=hook)
    stages[0] = ""  # (not every model call meets the hook: the stage stays after the last probe)
    try:
        assert failing.fired
        reason = speculating.statistics().speculative_off_reason
        assert reason.startswith("the load check raised RuntimeError") and "LU factorization" in reason
        assert warnings_about_speculation(caplog) == [f"speculative decoding is off: {reason}"]
        for n, sampling in enumerate((GREEDY, SEEDED)):
            prompt = edit_like(99, n)
            expected = await single(plain, f"p{n}", prompt, sampling)
            assert await single(speculating, f"s{n}", prompt, sampling) == expected
        assert speculating.statistics().speculative_steps == 0
        assert plain.statistics().speculative_off_reason == ""
    finally:
        await close_engine(speculating)
        await close_engine(plain)


async def test_a_verify_step_that_fails_on_the_device_fails_its_request_alone_and_speculation_turns_off(
        chain_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The first verify step's attention fails when the device computes it: the pool's lazy
    updates of every layer after it would raise in every later step, so that request fails,
    the pool starts again empty and speculation turns off; the next requests are served as
    without speculation."""
    plain = await load_engine(chain_dir, prefill_chunk_size=16)
    speculating = await load_engine(chain_dir, prefill_chunk_size=16, speculative="ngram")
    speculator = speculating._device.speculator
    assert speculator is not None and speculator.off_reason is None
    failing = FailingAttention(monkeypatch, lambda: speculator.verifying and speculator.off_reason is None)
    try:
        with (caplog.at_level(logging.WARNING, logger="adapters.engine_mlx"),
              pytest.raises(StatecoreError, match="LU factorization")):
            await single(speculating, "f", edit_like(99, 5), GREEDY)
        assert failing.fired
        stats = speculating.statistics()
        assert stats.speculative_off_reason.startswith("a verify step failed on the device (RuntimeError")
        assert (stats.rows_isolated, stats.speculative_steps) == (1, 0)
        assert len(warnings_about_speculation(caplog)) == 1
        for n, sampling in enumerate((GREEDY, SEEDED)):
            prompt = edit_like(40, n)
            expected = await single(plain, f"p{n}", prompt, sampling)
            assert await single(speculating, f"s{n}", prompt, sampling) == expected
        assert speculating.statistics().speculative_steps == 0
    finally:
        await close_engine(speculating)
        await close_engine(plain)


async def test_a_handoff_staged_in_the_pool_a_failed_verify_step_emptied_fails_typed(
        chain_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A handoff's first pieces wait in a slot of the pool while a verify step fails on the device:
    the pool starts again empty, so their KV is gone and the handoff's next piece fails typed (it
    never decodes from what is left); its cancel gives the slot back and the node goes on serving
    exactly."""
    plain = await load_engine(chain_dir, prefill_chunk_size=16, max_batch=4, max_num_batched_tokens=4 + 16)
    speculating = await load_engine(chain_dir, prefill_chunk_size=16, speculative="ngram")
    speculator = speculating._device.speculator
    assert speculator is not None and speculator.off_reason is None
    try:
        handed = edit_like(60, 7)
        _, pieces = await streamed_prefill(plain, RequestId("h"), handed, GREEDY)
        await plain.release_held(RequestId("h"))
        early = [piece for piece in pieces if not piece.last_step_started][:2]
        assert len(early) == 2 and early[-1].stop < len(handed)  # the join is not expected yet
        for piece in early:
            await speculating.receive_segment(RequestId("h"), piece, len(handed),
                                              max_tokens=GREEDY.max_tokens)
        assert "h" in speculating._device.slots.staged
        FailingAttention(monkeypatch, lambda: speculator.verifying and speculator.off_reason is None)
        with pytest.raises(StatecoreError, match="LU factorization"):
            await single(speculating, "f", edit_like(99, 5), GREEDY)
        with pytest.raises(StatecoreError) as lost:
            await speculating.receive_segment(RequestId("h"), pieces[len(early)], len(handed),
                                              max_tokens=GREEDY.max_tokens)
        assert lost.value.info.code is Code.ENGINE_FAILED and "slot pool" in lost.value.info.message
        await speculating.cancel(RequestId("h"))
        assert speculating._device.pool is not None
        assert speculating._device.pool.free_slots == speculating._device.pool.num_slots
        prompt = edit_like(40, 3)
        expected = await single(plain, "ref", prompt, GREEDY)
        assert await single(speculating, "after", prompt, GREEDY) == expected
    finally:
        await close_engine(speculating)
        await close_engine(plain)
