"""In-memory fakes of the ports, for tests: a deterministic engine with fault hooks.

`FakeEngine` "generates" token ids from a simple rule over the prompt so tests can predict
them, holds caches as byte strings, and can be told to fail or stall a phase for requests
whose prompt contains a marker token. This module may import `statecore` and trio; it must
never import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import trio

from effects.engine_port import (
    Decoded,
    EngineLiveness,
    EngineStatistics,
    GeneratedToken,
    KvBytes,
    KvPieces,
    KvSegment,
    LayerTravel,
    ModelInfo,
    PrefillOutcome,
    PrefixSummary,
    SamplingParams,
    SegmentSink,
    no_prefix_cache,
)
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId
from statecore.policy import decoded, token_finish

EOS = 0


@dataclass
class Faults:
    """Which phases fail (or stall) for prompts containing `marker`."""

    marker: int = 999
    fail: set[str] = field(default_factory=set)  # "prefill", "install", "decode"
    stall: set[str] = field(default_factory=set)


def fake_info(*, can_travel: bool = True) -> ModelInfo:
    layer = LayerTravel(0, "KVCache" if can_travel else "OpaqueCache", can_travel)
    return ModelInfo(
        name="fake",
        fingerprint="fake-1",
        context_length=4096,
        vocab_size=1000,
        eos_token_ids=frozenset({EOS}),
        prefill_chunk_size=64,
        layers=(layer,),
    )


def next_token(history: Sequence[int]) -> int:
    """The fake model: a deterministic function of the history, never EOS by itself."""
    return 1 + (sum(history) * 31 + len(history)) % 997


class FakeEngine:
    """`eos_at`: the n-th generated token (1: the one prefill samples) is EOS, for tests of how
    a generation ends on it; the engine honours `SamplingParams.ignore_eos` as the port says.
    `step_tokens`: the tokens a decode step gives a request (a verify step's several), read as
    one value as the port says: a request's stream carries its steps, each its tokens."""

    def __init__(self, faults: Faults | None = None, info: ModelInfo | None = None,
                 eos_at: int | None = None, step_tokens: int = 1) -> None:
        self.faults = faults or Faults()
        self.eos_at = eos_at
        self.step_tokens = step_tokens
        self.cached_tokens = 0  # what every prefill reports it took from a prefix cache
        # prompt starts "kept" (exported from here, or imported): a prefill starting with one
        # reports its length as cached, if more than `cached_tokens`
        self.prefixes: set[tuple[int, ...]] = set()
        self.summary_block_tokens = 0  # > 0: its prefix summary says it has a prefix cache (empty)
        self._info = info or fake_info()
        self.held: dict[RequestId, bytes] = {}
        self.arriving: dict[RequestId, list[tuple[int, int]]] = {}  # streamed pieces' token ranges
        self.decoding: dict[RequestId, trio.MemorySendChannel[list[GeneratedToken]]] = {}
        self._streams: dict[RequestId, trio.MemoryReceiveChannel[list[GeneratedToken]]] = {}
        self._cancelled: set[RequestId] = set()
        self._piece_came = trio.Event()  # set (and replaced) as a streamed piece is kept or given up

    @property
    def info(self) -> ModelInfo:
        return self._info

    async def _phase(self, name: str, prompt: Sequence[int]) -> None:
        await trio.sleep(0)
        if self.faults.marker in prompt:
            if name in self.faults.stall:
                await trio.sleep_forever()
            if name in self.faults.fail:
                raise StatecoreError(
                    ErrorInfo(Fault.BUG, Code.INJECTED_FAULT, f"injected fault in {name}")
                )

    async def prefill(
        self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        segments: SegmentSink | None = None, device_pieces: bool = False,
    ) -> PrefillOutcome:
        """With `segments`, the fake payload goes there in two pieces, as the prompt's head and
        its last token (every layer each) would: b"FAKE", then one byte per token."""
        await self._phase("prefill", prompt)
        payload = bytes(t % 256 for t in prompt)
        self.held[request_id] = payload
        layers = len(self._info.layers)
        if segments is not None:
            cuts = [0, len(prompt) - 1, len(prompt)] if len(prompt) > 1 else [0, 1]
            for start, stop in itertools.pairwise(cuts):
                segments(KvSegment(start, stop, 0, layers, KvPieces((b"FAKE", payload[start:stop]))))
        first = EOS if self.eos_at == 1 else next_token(prompt)
        cached = max([self.cached_tokens, *(len(p) for p in self.prefixes if tuple(prompt[: len(p)]) == p)])
        return PrefillOutcome(first, len(prompt), len(payload), cached_tokens=cached,
                              streamed=segments is not None)

    async def send_pieces_on_device(self, request_id: RequestId) -> bool:
        return False  # no GPU memory here

    def _longest_prefix(self, tokens: Sequence[int]) -> tuple[int, ...] | None:
        found = [p for p in self.prefixes if len(p) <= len(tokens) and tuple(tokens[: len(p)]) == p]
        return max(found, key=len, default=None)

    async def export_prefix(self, tokens: Sequence[int]) -> KvPieces:
        """The longest kept start of `tokens`: b"FAKP", then its token ids (4 bytes each)."""
        await trio.sleep(0)
        kept = self._longest_prefix(tokens)
        if kept is None:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.PREFIX_NOT_CACHED, "no such prefix"))
        return KvPieces((b"FAKP", b"".join(t.to_bytes(4, "little") for t in kept)))

    async def import_prefix(self, payload: KvBytes, tokens: Sequence[int]) -> int:
        await trio.sleep(0)
        data = bytes(payload)
        if data[:4] != b"FAKP" or len(data) % 4:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, "not a fake prefix payload"))
        kept = tuple(int.from_bytes(data[i : i + 4], "little") for i in range(4, len(data), 4))
        if kept != tuple(tokens[: len(kept)]):
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, "the prefix is not the prompt's"))
        self.prefixes.add(kept)
        return len(kept)

    async def export_held(self, request_id: RequestId) -> KvPieces:
        try:
            return KvPieces((b"FAKE", self.held[request_id]))
        except KeyError:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND, "no such cache")) from None

    async def release_held(self, request_id: RequestId) -> int:
        self.arriving.pop(request_id, None)
        return len(self.held.pop(request_id, b""))

    async def _begin(
        self, request_id: RequestId, prompt: Sequence[int], first: int, sampling: SamplingParams
    ) -> None:
        await self._phase("install", prompt)
        send, receive = trio.open_memory_channel[list[GeneratedToken]](sampling.max_tokens + 1)
        history = [*prompt, first]
        step: list[GeneratedToken] = []
        for produced in range(2, sampling.max_tokens + 1):
            token = EOS if produced == self.eos_at else next_token(history)
            history.append(token)
            # the same decision the real engine's device loop asks for
            reason = token_finish(token, {EOS}, ignore_eos=sampling.ignore_eos,
                                  remaining=sampling.max_tokens - produced)
            step.append(GeneratedToken(token, reason))
            if reason is not None or len(step) == self.step_tokens:
                send.send_nowait(step)
                step = []
            if reason is not None:
                break
        self.decoding[request_id] = send
        self._streams[request_id] = receive
        if self.faults.marker in prompt and "decode" in self.faults.fail:
            send.close()  # the stream ends early: the performer must fail the request

    async def decode_held(
        self, request_id: RequestId, prompt: Sequence[int], first_token: int, sampling: SamplingParams
    ) -> None:
        self.held.pop(request_id, None)
        await self._begin(request_id, prompt, first_token, sampling)

    async def install(
        self,
        request_id: RequestId,
        payload: KvBytes,
        prompt: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
    ) -> None:
        if bytes(payload[:4]) != b"FAKE":
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, "not a fake payload"))
        await self._begin(request_id, prompt, first_token, sampling)

    async def receive_segment(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int, *,
                              max_tokens: int, index: int | None = None) -> None:
        await trio.sleep(0)
        data = segment.payload.joined()
        if data[:4] != b"FAKE" or len(data) - 4 != segment.stop - segment.start:
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED, "not a fake segment"))
        self.arriving.setdefault(request_id, []).append((segment.start, segment.stop))
        self._pieces_changed()

    def _pieces_changed(self) -> None:
        self._piece_came.set()
        self._piece_came = trio.Event()

    async def install_segments(
        self, request_id: RequestId, prompt: Sequence[int], first_token: int, sampling: SamplingParams,
        pieces: int | None = None,
    ) -> None:
        # asked while its last pieces are still being checked: it waits for them, as the real one
        while pieces is not None and len(self.arriving.get(request_id, [])) < pieces:
            if request_id in self._cancelled:
                raise StatecoreError(ErrorInfo(Fault.CANCELLED, Code.CANCELLED, "cancelled"))
            await self._piece_came.wait()
        covered = sum(stop - start for start, stop in self.arriving.pop(request_id, []))
        if covered != len(prompt):
            raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_TRUNCATED, "segments miss tokens"))
        await self._begin(request_id, prompt, first_token, sampling)

    async def stream(self, request_id: RequestId) -> AsyncIterator[Decoded]:
        receive = self._streams.get(request_id)
        if receive is None:
            return
        async with receive:
            async for step in receive:
                await trio.sleep(0.001)  # a decode step takes time
                if step[-1].finish_reason is not None:  # the decoder frees a finished slot itself
                    self.decoding.pop(request_id, None)
                    self._streams.pop(request_id, None)
                for event in decoded(step):
                    yield event

    async def cancel(self, request_id: RequestId) -> None:
        self.arriving.pop(request_id, None)
        self._cancelled.add(request_id)
        self._pieces_changed()
        send = self.decoding.pop(request_id, None)
        if send is not None:
            send.close()
        self._streams.pop(request_id, None)

    def liveness(self) -> EngineLiveness:
        stats = self.statistics()  # (a test may set `statistics` to say otherwise)
        return EngineLiveness(stats.device_thread_alive, stats.stalled_s)

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            decoding=len(self.decoding),
            held_caches=len(self.held),
            held_bytes=sum(len(v) for v in self.held.values()),
            device_thread_alive=True,
            arriving=len(self.arriving),
        )

    async def prefix_summary(self, since: int | None = None) -> PrefixSummary | None:
        """The fake's summary is empty: its kept prefixes are not blocks (a puller then skips, as on
        a node without a prefix cache, unless `summary_block_tokens` says otherwise)."""
        if self.summary_block_tokens <= 0:
            return no_prefix_cache(since)
        return PrefixSummary(self.summary_block_tokens, len(self.prefixes))

    async def aclose(self) -> None:
        for rid in list(self.decoding):
            await self.cancel(rid)


__all__ = ["EOS", "FakeEngine", "Faults", "fake_info", "next_token"]
