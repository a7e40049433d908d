"""A streamed handoff's pieces written into the request's slot as they arrive (`adapters.mlx.staging`),
on real engines and a tiny llama: the tokens are the single node's, a staged slot lying among
running rows is never written over by their steps, and a request that leaves, or whose pieces do
not cover its prompt, gives its slot back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import trio
import trio.testing

from adapters.mlx import MlxEngine, kv_out, slot_lane
from adapters.mlx.compiled import CompiledSlotStep
from adapters.mlx.device_pieces import DevicePiece, encode
from effects.engine_port import KvPieces, KvSegment, SamplingParams
from statecore.errors import Code, StatecoreError
from statecore.ids import RequestId
from support.tiny_models import cached_checkpoint
from tests.integration.engines import load_into, opened_engines, sent_tokens, streamed_prefill

CHUNK = 16
GREEDY = SamplingParams(max_tokens=24)


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * salt) % 500 + 2 for i in range(n)]


async def served(engine: MlxEngine, rid: str, prompt: Sequence[int],
                 sampling: SamplingParams = GREEDY) -> list[int]:
    outcome = await engine.prefill(RequestId(rid), prompt, sampling)
    await engine.decode_held(RequestId(rid), prompt, outcome.first_token, sampling)
    return [outcome.first_token] + await sent_tokens(engine.stream(RequestId(rid)))


async def pieces_of(source: MlxEngine, rid: str, prompt: Sequence[int]) -> tuple[int, list[KvSegment]]:
    """The first token and the streamed pieces of a prompt prefilled on `source` (a chunk a
    step: several pieces), its held cache released."""
    outcome, pieces = await streamed_prefill(source, RequestId(rid), prompt, GREEDY)
    await source.release_held(RequestId(rid))
    assert len(pieces) > 2
    return outcome.first_token, pieces


def staged(engine: MlxEngine) -> dict[str, Any]:
    return engine._device.slots.staged.entries


async def steps_pass(engine: MlxEngine, count: int) -> None:
    """Wait until the engine's device loop has taken `count` more steps."""
    before = engine._device.profile.spent["step"][0]
    with trio.fail_after(60):
        while engine._device.profile.spent["step"][0] < before + count:
            await trio.sleep(0.002)


async def source_and_decode(opened: list[MlxEngine], max_batch: int) -> tuple[MlxEngine, MlxEngine]:
    """A prefill engine that computes a chunk a step (a prompt streams in several pieces) and a
    decode engine, both on the tiny llama."""
    path = cached_checkpoint("llama")
    options: dict[str, Any] = dict(prefill_chunk_size=CHUNK, step_target_ms=0.0, max_batch=max_batch)
    source = await load_into(opened, path, **options, max_num_batched_tokens=CHUNK + 4, prefix_cache_bytes=0)
    return source, await load_into(opened, path, **options)


async def decoding(engine: MlxEngine, count: int) -> None:
    with trio.fail_after(60):
        while engine.statistics().decoding < count:
            await trio.sleep(0.005)


@pytest.mark.parametrize("budget", ["a step's share", "a layer a step"])
async def test_pieces_staged_among_running_rows_decode_as_a_single_node(
    budget: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows in slots 0 and 2 decode while a handed-off prompt's pieces go into slot 1 over many of
    their steps; each request's tokens are what one node computes alone. With one layer's piece
    written a step, the request joins before its pieces are all written and decodes once they
    are."""
    slow = budget == "a layer a step"
    if slow:
        monkeypatch.setattr(slot_lane, "STAGED_BYTES_PER_STEP", 1)  # each step writes one piece
    async with opened_engines() as opened:
        source, decode = await source_and_decode(opened, max_batch=4)
        alone = await load_into(opened, cached_checkpoint("llama"), prefill_chunk_size=CHUNK,
                                step_target_ms=0.0, max_batch=4)
        newcomer = prompt_of(70, salt=3)
        first_token, pieces = await pieces_of(source, "new", newcomer)
        long_run = replace(GREEDY, max_tokens=400)
        rows = {name: prompt_of(20 + index, salt=index) for index, name in enumerate(("a", "b", "c"))}
        results: dict[str, list[int]] = {}

        async def run(name: str, sampling: SamplingParams) -> None:
            results[name] = await served(decode, name, rows[name], sampling)

        async with trio.open_nursery() as nursery:
            for count, name in enumerate(rows, start=1):  # slots 0, 1, 2 in order of joining
                nursery.start_soon(run, name, replace(GREEDY, max_tokens=40) if name == "b" else long_run)
                await decoding(decode, count)
            with trio.fail_after(60):  # "b" ends: slot 1 is free, between the running rows
                while "b" not in results or decode.statistics().decoding != 2:
                    await trio.sleep(0.005)
            for piece in pieces:
                await decode.receive_segment(RequestId("new"), piece, len(newcomer),
                                             max_tokens=GREEDY.max_tokens)
                assert staged(decode)["new"].slot == 1  # inside every step's range of rows
                if not slow:
                    await steps_pass(decode, 3)  # the running rows' steps go on meanwhile
            await decode.install_segments(RequestId("new"), newcomer, first_token, GREEDY)
            if slow:
                entry = staged(decode)["new"]
                assert entry.pending and entry.row is not None and entry.row.staging
            else:  # its last piece, within a step's share, is written by the next step, which it joins
                await steps_pass(decode, 1)
                assert not staged(decode)
            tokens = [first_token] + await sent_tokens(decode.stream(RequestId("new")))
            for name in ("a", "c"):
                await decode.cancel(RequestId(name))
        assert tokens == await served(alone, "new", newcomer)
        for name in ("a", "c"):  # cut short: their tokens so far are the single node's
            expected = await served(alone, name, rows[name], long_run)
            assert len(results[name]) > 2 * len(pieces)
            assert results[name] == expected[: len(results[name])]


async def test_a_staged_request_s_join_is_traced_ahead_so_no_step_traces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`compile_decode` on: a handed-off prompt longer than the running row attends over a length
    no step has traced; its first staged piece traces that shape (`CompiledSlotStep.prepare`), so
    neither the steps covering its staged slot nor the step it joins trace anything (a trace is
    the streams' longest gap on a GPU). Its tokens and the running row's are the single node's."""
    traced_in_steps: list[int] = []
    original = CompiledSlotStep.__call__

    def watching(self: CompiledSlotStep, tokens: Any, offsets: Sequence[int]) -> Any:
        before = self.traces
        logits = original(self, tokens, offsets)
        if self.traces > before:
            traced_in_steps.append(max(offsets))
        return logits

    async with opened_engines() as opened:
        path = cached_checkpoint("llama")
        options: dict[str, Any] = dict(prefill_chunk_size=CHUNK, step_target_ms=0.0, max_batch=4,
                                       shape_bucket=16)
        source = await load_into(opened, path, **options, max_num_batched_tokens=CHUNK + 4,
                                 prefix_cache_bytes=0)
        decode = await load_into(opened, path, **options, compile_decode="on")
        alone = await load_into(opened, path, **options)
        compiled = decode._device.compiled
        assert compiled is not None
        newcomer = prompt_of(200, salt=5)  # attends 256 positions; the running row fewer than 128
        first_token, pieces = await pieces_of(source, "new", newcomer)
        running = prompt_of(20, salt=1)
        short_run = replace(GREEDY, max_tokens=90)
        results: dict[str, list[int]] = {}

        async def run() -> None:
            results["a"] = await served(decode, "a", running, short_run)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await decoding(decode, 1)
            await steps_pass(decode, 2)  # its own shape is traced by now
            monkeypatch.setattr(CompiledSlotStep, "__call__", watching)
            traces = compiled.traces
            for piece in pieces:
                await decode.receive_segment(RequestId("new"), piece, len(newcomer),
                                             max_tokens=GREEDY.max_tokens)
            assert compiled.traces == traces + 1  # by the first piece's staging, not by a step
            await decode.install_segments(RequestId("new"), newcomer, first_token, GREEDY)
            tokens = [first_token] + await sent_tokens(decode.stream(RequestId("new")))
        assert traced_in_steps == []
        assert tokens == await served(alone, "new", newcomer)
        assert results["a"] == await served(alone, "a", running, short_run)


@pytest.mark.parametrize("ending", ["cancel", "missing piece", "release"])
async def test_a_staged_request_that_ends_gives_its_slot_back(ending: str) -> None:
    """Cancelled while its pieces arrive, installed with a piece missing (a typed KV_TRUNCATED),
    or released without an install (its first token ended it): its slot is free again and a
    later request decodes in it exactly."""
    async with opened_engines() as opened:
        source, decode = await source_and_decode(opened, max_batch=2)
        newcomer = prompt_of(70, salt=5)
        first_token, pieces = await pieces_of(source, "new", newcomer)
        for piece in pieces[:-1]:
            await decode.receive_segment(RequestId("new"), piece, len(newcomer),
                                         max_tokens=GREEDY.max_tokens)
        assert "new" in staged(decode)
        if ending == "cancel":
            await decode.cancel(RequestId("new"))
        elif ending == "release":
            await decode.release_held(RequestId("new"))
        else:
            with pytest.raises(StatecoreError) as raised:
                await decode.install_segments(RequestId("new"), newcomer, first_token, GREEDY)
            assert raised.value.info.code is Code.KV_TRUNCATED
        assert not staged(decode)
        assert not decode._device.handoffs_expected  # nothing holds its prefill work back any more
        assert decode._device.pool is not None and decode._device.pool.free_slots == 2
        # both slots serve again, the once staged one included
        async with trio.open_nursery() as nursery:
            got: dict[str, list[int]] = {}

            async def run(name: str) -> None:
                got[name] = await served(decode, name, prompt_of(30, salt=len(name)))

            nursery.start_soon(run, "x")
            nursery.start_soon(run, "yy")
        assert decode.statistics().arriving == 0
        for name, tokens in got.items():
            assert tokens == await served(source, name + "-alone", prompt_of(30, salt=len(name)))


async def test_a_step_s_kv_leaves_in_pieces_of_a_few_layers_and_installs_exactly(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces capped at one layer's share of a step: every step's KV leaves in one piece per
    layer, each staged into the slot as it comes; the tokens are the single node's."""
    async with opened_engines() as opened:
        source, decode = await source_and_decode(opened, max_batch=2)
        newcomer = prompt_of(70, salt=6)
        _, whole = await pieces_of(source, "whole", newcomer)
        layers = len(source.info.layers)
        one_layer = max(piece.payload.nbytes for piece in whole) // layers // 2
        monkeypatch.setattr(kv_out, "STREAMED_PIECE_BYTES", one_layer)
        first_token, pieces = await pieces_of(source, "new", newcomer)
        assert len(pieces) >= layers * len(whole) > len(whole)
        assert all(piece.end_layer - piece.first_layer == 1 for piece in pieces)
        for piece in pieces:
            await decode.receive_segment(RequestId("new"), piece, len(newcomer),
                                         max_tokens=GREEDY.max_tokens)
        await decode.install_segments(RequestId("new"), newcomer, first_token, GREEDY)
        tokens = [first_token] + await sent_tokens(decode.stream(RequestId("new")))
        assert tokens == await served(source, "alone", newcomer)


async def test_the_pieces_sent_while_the_last_step_runs_say_so_and_the_decode_node_expects_the_join() -> None:
    """The prefill engine's steps are pipelined (the next is built before one is read back), so
    the pieces it hands out while the step computing the prompt's last chunk runs are flagged;
    given one, the decode engine expects the request's join (its steps take no prefill work of
    their own meanwhile) until the request is installed, or cancelled."""
    async with opened_engines() as opened:
        source, decode = await source_and_decode(opened, max_batch=2)
        newcomer = prompt_of(70, salt=7)  # a chunk a step: 16, 32, 48, 64, then 70
        first_token, pieces = await pieces_of(source, "new", newcomer)
        assert [piece.last_step_started for piece in pieces] == [piece.stop == 64 for piece in pieces]
        for ending in ("install", "cancel"):
            for piece in pieces[:-1]:
                await decode.receive_segment(RequestId(ending), piece, len(newcomer),
                                             max_tokens=GREEDY.max_tokens)
            assert set(decode._device.handoffs_expected) == {ending}
            if ending == "cancel":
                await decode.cancel(RequestId(ending))
            else:
                await decode.receive_segment(RequestId(ending), pieces[-1], len(newcomer),
                                             max_tokens=GREEDY.max_tokens)
                await decode.install_segments(RequestId(ending), newcomer, first_token, GREEDY)
                tokens = [first_token] + await sent_tokens(decode.stream(RequestId(ending)))
                assert tokens == await served(source, "alone", newcomer)
            assert not decode._device.handoffs_expected


@pytest.mark.parametrize("corrupt", [False, True])
async def test_pieces_received_side_by_side_are_kept_in_the_stream_s_order(corrupt: bool) -> None:
    """A stream's pieces checked side by side (`index`), their calls started last piece first:
    each is kept only after every earlier one (a slot takes a layer's tokens in order) and the
    tokens are the single node's. A corrupt piece fails its call and every later one (typed),
    keeps nothing after it, and the request's cancel gives everything back."""
    async with opened_engines() as opened:
        source, decode = await source_and_decode(opened, max_batch=2)
        decode._arriving.checks = trio.CapacityLimiter(4)
        newcomer = prompt_of(70, salt=8)
        first_token, pieces = await pieces_of(source, "new", newcomer)
        bad = 1
        if corrupt:  # one byte of the second piece's arrays flipped: its checksum fails
            data = bytearray(pieces[bad].payload.joined())
            data[len(data) // 2] ^= 0xFF
            pieces[bad] = replace(pieces[bad], payload=KvPieces((bytes(data),)))
        outcomes: dict[int, BaseException | None] = {}

        async def receive(index: int) -> None:
            try:
                await decode.receive_segment(RequestId("new"), pieces[index], len(newcomer),
                                             max_tokens=GREEDY.max_tokens, index=index)
            except StatecoreError as exc:
                outcomes[index] = exc
            else:
                outcomes[index] = None

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for index in reversed(range(len(pieces))):
                    nursery.start_soon(receive, index)
                    await trio.sleep(0.01)  # the later pieces' calls are well under way first
        if not corrupt:
            assert set(outcomes.values()) == {None}
            await decode.install_segments(RequestId("new"), newcomer, first_token, GREEDY)
            tokens = [first_token] + await sent_tokens(decode.stream(RequestId("new")))
            assert tokens == await served(source, "alone", newcomer)
            return
        assert all(outcomes[index] is None for index in range(bad)), outcomes
        failed = [outcomes[index] for index in range(bad, len(pieces))]
        assert isinstance(failed[0], StatecoreError) and failed[0].info.code is Code.KV_CHECKSUM
        assert all(isinstance(exc, StatecoreError) and exc.info.code is Code.KV_MALFORMED
                   and "earlier" in exc.info.message for exc in failed[1:])
        covered = staged(decode)["new"].covered
        assert max(covered) <= pieces[bad - 1].stop  # nothing of the corrupt piece or after it
        await decode.cancel(RequestId("new"))
        assert not staged(decode) and decode._callers.get("new") is None
        assert decode._device.pool is not None and decode._device.pool.free_slots == 2


async def test_a_piece_in_gpu_memory_reaching_a_node_that_reads_none_fails_that_request_alone() -> None:
    """A device piece document (`adapters.mlx.device_pieces`: the piece stayed in the sender's GPU
    memory) on a node whose engine cannot read another process's GPU memory (here MLX on the CPU)
    fails its request typed; the node then serves the next request as a single node does."""
    async with opened_engines() as opened:
        source, decode = await source_and_decode(opened, max_batch=2)
        prompt = prompt_of(40, salt=3)
        _, pieces = await pieces_of(source, "p", prompt)
        head = pieces[0]
        layers = head.end_layer - head.first_layer
        document = encode(DevicePiece("a" * 32, bytes(64), 0, decode.info.fingerprint, head.stop - head.start,
                                      "float32", ((1, 1, head.stop - head.start, 8),) * (2 * layers)))
        assert not decode.info.device_pieces
        with pytest.raises(StatecoreError) as raised:
            await decode.receive_segment(RequestId("d"), replace(head, payload=KvPieces((document,))),
                                         len(prompt), max_tokens=GREEDY.max_tokens)
        assert raised.value.info.code is Code.KV_MALFORMED and "GPU memory" in raised.value.info.message
        await decode.cancel(RequestId("d"))
        assert await served(decode, "next", prompt) == await served(source, "alone", prompt)


@pytest.mark.parametrize("max_tokens", [24, 2])
async def test_a_staged_prompt_is_kept_after_its_first_step_and_its_next_turn_is_exact(
    max_tokens: int,
) -> None:
    """On a decode node that keeps conversations, a staged handoff's whole chunks go into the
    prefix cache once its first decode step is read back, not on the step it joins (the copy
    came before its second token); one that ends at that step keeps them too. Its tokens are the
    single node's, and its next turn starts from the kept chunks with the single node's tokens."""
    async with opened_engines() as opened:
        source, _ = await source_and_decode(opened, max_batch=2)
        decode = await load_into(opened, cached_checkpoint("llama"), prefill_chunk_size=CHUNK,
                                 step_target_ms=0.0, max_batch=2, keep_conversations=True)
        device = decode._device
        counted_at_keep: list[int] = []  # the request's decode tokens counted when its chunks were kept
        keep_installed = device.keeping.keep_installed

        def recording(tokens: Sequence[int], cache: list[Any]) -> None:
            live = device.live.get("new")
            counted_at_keep.append(-1 if live is None else sampling.max_tokens - 1 - live.remaining)
            keep_installed(tokens, cache)

        device.keeping.keep_installed = recording  # type: ignore[method-assign]
        sampling = replace(GREEDY, max_tokens=max_tokens)
        newcomer = prompt_of(70, salt=9)  # blocks end at 16, 32, 48, 64
        first_token, pieces = await pieces_of(source, "new", newcomer)
        for piece in pieces:
            await decode.receive_segment(RequestId("new"), piece, len(newcomer), max_tokens=max_tokens)
        await decode.install_segments(RequestId("new"), newcomer, first_token, sampling)
        tokens = [first_token] + await sent_tokens(decode.stream(RequestId("new")))
        assert tokens == await served(source, "alone", newcomer, sampling)
        assert counted_at_keep == [1]
        assert decode.statistics().prefix_cache_bytes > 0
        second = [*newcomer, *tokens, *prompt_of(5, salt=4)]
        outcome = await decode.prefill(RequestId("next"), second, GREEDY)
        assert outcome.cached_tokens >= 64
        await decode.decode_held(RequestId("next"), second, outcome.first_token, GREEDY)
        following = [outcome.first_token] + await sent_tokens(decode.stream(RequestId("next")))
        assert following == await served(source, "next-alone", second)


async def test_a_handed_off_prompt_whose_keep_raises_still_decodes_exactly() -> None:
    """Keeping a handed-off prompt's chunks is a saving, never the request's fate: a copy that
    raises after its first step keeps nothing, and the request and its neighbour decode on as a
    single node's."""
    async with opened_engines() as opened:
        source, _ = await source_and_decode(opened, max_batch=2)
        decode = await load_into(opened, cached_checkpoint("llama"), prefill_chunk_size=CHUNK,
                                 step_target_ms=0.0, max_batch=2, keep_conversations=True)

        def raising(tokens: Sequence[int], cache: list[Any]) -> None:
            raise RuntimeError("injected: the keep's copy failed")

        decode._device.keeping.keep_installed = raising  # type: ignore[method-assign]
        newcomer, neighbour = prompt_of(70, salt=10), prompt_of(30, salt=11)
        first_token, pieces = await pieces_of(source, "new", newcomer)
        got: dict[str, list[int]] = {}

        async def neighbour_row() -> None:
            got["b"] = await served(decode, "b", neighbour)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(neighbour_row)
            await decoding(decode, 1)
            for piece in pieces:
                await decode.receive_segment(RequestId("new"), piece, len(newcomer),
                                             max_tokens=GREEDY.max_tokens)
            await decode.install_segments(RequestId("new"), newcomer, first_token, GREEDY)
            got["new"] = [first_token] + await sent_tokens(decode.stream(RequestId("new")))
        assert got["new"] == await served(source, "alone", newcomer)
        assert got["b"] == await served(source, "b-alone", neighbour)
        prefix = decode._device.prefix
        assert prefix is not None and prefix.index.cached(prefix.keys_of(newcomer)) == 0
        assert decode._device.pool is not None and decode._device.pool.free_slots == 2


async def test_on_the_cpu_a_slot_row_s_token_leaves_before_the_batch_lane_steps() -> None:
    """A row in the slot lane beside one too long for a slot (the batch lane): on the CPU, where
    a step's launch computes it, each slot step's token is handed out before the batch lane
    computes its own step (a handed-off request's second token waited for it)."""
    async with opened_engines() as opened:
        engine = await load_into(opened, cached_checkpoint("llama"), prefill_chunk_size=CHUNK,
                                 step_target_ms=0.0, max_batch=2, max_slot_tokens=128)
        device = engine._device
        long_run, short_run = replace(GREEDY, max_tokens=200), replace(GREEDY, max_tokens=24)
        built = [0]  # slot steps built with the short row
        behind: list[int] = []  # at each batch-lane step: its slot steps built less its tokens counted
        build, batch_step = device.slots.build, device.batch.step

        def counting_build(rows: list[Any]) -> Any:
            built[0] += any(live.request_id == "short" for live in rows)
            return build(rows)

        def watching_step() -> None:
            live = device.live.get("short")
            if live is not None and live.slot is not None and built[0]:
                behind.append(built[0] - (short_run.max_tokens - 1 - live.remaining))
            batch_step()

        device.slots.build = counting_build  # type: ignore[method-assign]
        device.batch.step = watching_step  # type: ignore[method-assign]
        got: dict[str, list[int]] = {}

        async def run(name: str, prompt: list[int], sampling: SamplingParams) -> None:
            got[name] = await served(engine, name, prompt, sampling)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "long", prompt_of(20, salt=12), long_run)
            await decoding(engine, 1)
            nursery.start_soon(run, "short", prompt_of(20, salt=13), short_run)
            await decoding(engine, 2)
            with trio.fail_after(60):
                while "short" not in got:
                    await trio.sleep(0.005)
            await engine.cancel(RequestId("long"))
        assert len(behind) >= 10 and set(behind) == {0}, behind
        assert got["short"] == await served(engine, "short-again", prompt_of(20, salt=13), short_run)


@pytest.mark.parametrize("corrupt", [False, True])
async def test_an_install_asked_while_the_last_pieces_are_checked_waits_for_them(corrupt: bool) -> None:
    """`install_segments(pieces=N)`, asked as a decode node's stream ends, before its last pieces'
    checks are done (as `effects.interpret.StreamReceiver` asks it): the install starts once they
    are kept and the tokens are the single node's; a corrupt last piece fails the install with
    that piece's own error (its checksum), and the request's cancel gives everything back."""
    async with opened_engines() as opened:
        source, decode = await source_and_decode(opened, max_batch=2)
        decode._arriving.checks = trio.CapacityLimiter(4)
        newcomer = prompt_of(70, salt=9)
        first_token, pieces = await pieces_of(source, "new", newcomer)
        if corrupt:  # one byte of the last piece's arrays flipped: its checksum fails
            data = bytearray(pieces[-1].payload.joined())
            data[len(data) // 2] ^= 0xFF
            pieces[-1] = replace(pieces[-1], payload=KvPieces((bytes(data),)))
        installed: list[BaseException | None] = []

        async def install() -> None:
            try:
                await decode.install_segments(RequestId("new"), newcomer, first_token, GREEDY,
                                              pieces=len(pieces))
            except StatecoreError as exc:
                installed.append(exc)
            else:
                installed.append(None)

        async def receive(index: int) -> None:
            with contextlib.suppress(StatecoreError):
                await decode.receive_segment(RequestId("new"), pieces[index], len(newcomer),
                                             max_tokens=GREEDY.max_tokens, index=index)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(install)  # asked first: no piece's call has started yet
                await trio.testing.wait_all_tasks_blocked()
                assert not installed
                for index in range(len(pieces)):
                    nursery.start_soon(receive, index)
        if not corrupt:
            assert installed == [None]
            tokens = [first_token] + await sent_tokens(decode.stream(RequestId("new")))
            assert tokens == await served(source, "alone", newcomer)
            return
        failure = installed[0]
        assert isinstance(failure, StatecoreError) and failure.info.code is Code.KV_CHECKSUM
        await decode.cancel(RequestId("new"))
        assert not staged(decode) and decode._callers.get("new") is None
        assert decode._device.pool is not None and decode._device.pool.free_slots == 2
