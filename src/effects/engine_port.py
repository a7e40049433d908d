"""The Engine port: what the serving loops need from a model runtime, as a Protocol.

The interpreter and the HTTP adapters talk to an engine only through this port; the MLX
implementation lives in `adapters.mlx`, and `effects.fakes` has an in-memory one for
tests. Everything here is plain data and one Protocol; a decoder's token (`GeneratedToken`) and
the events a step of them makes (`decoded`) are the core's (`statecore.events`, `statecore.policy`),
named here as the port's vocabulary. This module may import `statecore` and trio; it must never
import httpx, mlx or mlx_lm.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from statecore.events import Finished, GeneratedToken, TokenLogprobs, TokensGenerated
from statecore.ids import RequestId

# A KV payload as it arrives: a decode node receives into reusable buffers and passes a view of
# one. Whoever takes one reads it within the call and keeps no reference after returning, so the
# buffer can serve the next pull.
KvBytes = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class KvPieces:
    """An exported KV payload as the buffers it is made of, in order: the wire bytes are their
    concatenation, then `seal()`'s bytes. The tensors' own memory is sent piece by piece instead
    of being copied into one body first, and the pieces can go out while `seal` (the end frame:
    a checksum over all of them) is still being computed. `seal` blocks until it is ready, so
    call it from a worker thread; None when the pieces are already the whole payload."""

    pieces: tuple[KvBytes, ...]
    seal: Callable[[], bytes] | None = None
    seal_nbytes: int = 0
    # Where the whole payload (its end frame included) already lies in shared memory, when it
    # does: an adapter's reference (`adapters.kv.shm_region.ShmRef`) that a KV transport or an engine
    # core on this host hands on instead of copying the bytes. Valid while this value lives.
    shared: object | None = None

    @property
    def nbytes(self) -> int:
        return sum(memoryview(piece).nbytes for piece in self.pieces) + self.seal_nbytes

    def joined(self) -> bytes:
        """The whole payload as one bytes object (blocks on `seal`)."""
        return b"".join([*self.pieces, self.seal() if self.seal is not None else b""])


@dataclass(frozen=True, slots=True)
class KvSegment:
    """One piece of a cache streamed while its prompt is computed: tokens [start, stop) of
    layers [first_layer, end_layer), as a complete KV wire-format payload of its own."""

    start: int
    stop: int
    first_layer: int
    end_layer: int
    payload: KvPieces
    # the prefill node has started the step that computes the prompt's last pieces: the decode
    # node keeps its steps free of prefill work until the request joins
    last_step_started: bool = False


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples. temperature 0 means greedy; seed None means unseeded."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # vLLM's ignore_eos: an EOS token is an ordinary token (the stream goes on) and the request
    # ends only at max_tokens, with finish_reason "length"
    ignore_eos: bool = False
    min_p: float = 0.0  # keep tokens at least min_p x the most likely one's probability (0: off)
    # XTC ("exclude top choices", mlx-lm's): with probability xtc_probability a draw leaves out every
    # token above xtc_threshold but the least likely of them; never the special tokens (newline, EOS)
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] = ()
    # Logits shaping, before the log-softmax (greedy requests too), in this order; each penalty
    # looks at the last `*_context_size` tokens of prompt + generated (0 or penalty 0: off).
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 0.0  # a repeated token's logit: x penalty if < 0, else / penalty
    repetition_context_size: int = 20
    presence_penalty: float = 0.0  # subtracted once from each repeated token's logit
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # subtracted from a token's logit per repetition
    frequency_context_size: int = 20
    # With each token, its log-probability and the `logprobs` most likely alternatives' (None:
    # none of it). The distribution is the shaped one, before temperature (mlx-lm's choice).
    logprobs: int | None = None
    # Structured output: the canonical JSON text of the constraint (`adapters.grammar`:
    # `{"type":"json_object"}` or `{"type":"json_schema","schema":{...}}`); every draw, the first
    # one on the prefill node included, takes only what its grammar allows. None: free text.
    response_format: str | None = None
    # n > 1: this request is choice `choice` of the `choices` generations one client request asked
    # for, all sharing `choice_group` (the client's request id). An engine decodes a group side by
    # side in a fixed layout (in mlx-lm's batch generator they join its batch in one step, in choice
    # order), so a choice's numbers do not depend on when each one arrived.
    choice_group: str = ""
    choice: int = 0
    choices: int = 1
    # A LoRA adapter among those the node serves (`--adapters NAME=PATH`), by name: every model
    # call computes this request's rows with it (adapters.mlx.lora_rows). None: the base model.
    adapter: str | None = None
    # Speculative decoding's drafts for this request: at most this many a verify step (the node's
    # --num-draft-tokens caps it; 0: the request never speculates). None: the node's number. It
    # changes how fast the request decodes, never a token.
    num_draft_tokens: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalties(self) -> tuple[tuple[str, float, int], ...]:
        """The penalties in force: (kind, penalty, context size)."""
        candidates = (("repetition", self.repetition_penalty, self.repetition_context_size),
                      ("presence", self.presence_penalty, self.presence_context_size),
                      ("frequency", self.frequency_penalty, self.frequency_context_size))
        return tuple(c for c in candidates if c[1] != 0.0 and c[2] > 0)

    @property
    def shapes_logits(self) -> bool:
        """The logits are changed before sampling (a bias or a penalty is in force)."""
        return bool(self.logit_bias) or bool(self.penalties)


@dataclass(frozen=True, slots=True)
class LayerTravel:
    """Whether one layer's cache class can be handed off, and why not if it cannot."""

    index: int
    class_name: str
    can_travel: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a node knows about its loaded model, reported once at load."""

    name: str
    fingerprint: str  # hash of config, dtype, kv_bits and prefill chunk size
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    prefill_chunk_size: int
    layers: tuple[LayerTravel, ...] = field(default=())
    # the model's parameter bytes each rank holds (one entry on a one-rank node; a tensor- or
    # pipeline-parallel instance's ranks each hold a share); a report, not part of the identity
    parameter_bytes_by_rank: tuple[int, ...] = field(default=(), compare=False)
    adapters: tuple[str, ...] = ()  # the LoRA adapters a request may name (`--adapters`), in order
    # this engine sends and takes a streamed handoff's pieces in GPU memory, device to device, with
    # another engine on this host (`prefill(device_pieces=True)`); a report, not the identity
    device_pieces: bool = field(default=False, compare=False)

    @property
    def can_travel(self) -> bool:
        """True only when there is at least one layer and every layer can travel.

        An empty layer list is *not* "all supported": that vacuous truth is the bug the
        project started from.
        """
        return bool(self.layers) and all(layer.can_travel for layer in self.layers)

    @property
    def untravelable_classes(self) -> tuple[str, ...]:
        if not self.layers:
            return ("<no cache layers reported>",)
        return tuple(sorted({lay.class_name for lay in self.layers if not lay.can_travel}))


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """The result of prefilling one prompt: the first sampled token, the cache held, and how many
    of the prompt's tokens came from the prefix cache instead of being computed (whole chunks)."""

    first_token: int
    prompt_tokens: int
    held_bytes: int
    first_logprobs: TokenLogprobs | None = None
    cached_tokens: int = 0
    streamed: bool = False  # every piece of the cache went to the prefill's segment sink


# Called in trio, in order, never blocking: with each piece of a streamed prefill's cache, and with
# its outcome as soon as the first token is read back, ahead of the pieces of the step that
# sampled it (`prefill` returns the same outcome after the last piece).
SegmentSink = Callable[[KvSegment | PrefillOutcome], None]


Decoded = TokensGenerated | Finished  # what `Engine.stream` yields (`statecore.policy.decoded`)


@dataclass(frozen=True, slots=True)
class EngineLiveness:
    """Whether what runs the engine (its device thread, or its core process) is alive, and the
    seconds it has been busy without finishing a step or a job (0 while idle): all the node's
    progress watchdog asks, ten times a second, without building a whole `EngineStatistics`."""

    alive: bool
    stalled_s: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A frozen snapshot of what the engine holds right now (for leak checks and metrics)."""

    decoding: int  # requests live in the batched decoder (or the solo lane)
    held_caches: int  # prefilled caches held for a handoff
    held_bytes: int
    device_thread_alive: bool
    arriving: int = 0  # streamed handoffs whose pieces are arriving (kept, not yet installed)
    # Counters since start: model calls computed again after one raised, and requests failed
    # alone because their row kept raising (the rest of their step went on).
    step_retries: int = 0
    rows_isolated: int = 0
    # Seconds the engine has been busy without finishing a step or a job (0 while idle): what
    # the node's progress watchdog reads (--stall-timeout).
    stalled_s: float = 0.0
    # KV memory: bytes reserved by live requests for their own caches, of what they may take in
    # all (the node's KV budget less what the slot layout has set aside).
    kv_reserved_bytes: int = 0
    kv_budget_bytes: int = 0
    # The device allocator's bytes in use now and at most so far (weights, caches, activations).
    device_memory_bytes: int = 0
    device_peak_bytes: int = 0
    # The prefix cache: bytes of kept prompt blocks (they give way to requests), prompts looked
    # up, prompts that started from kept blocks, the prompt tokens those did not compute, and
    # blocks forgotten (for capacity, or for a request that needed the memory).
    prefix_cache_bytes: int = 0
    prefix_cache_hits: int = 0
    prefix_tokens_reused: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_evictions: int = 0
    # Its host tier (where the device's memory is not the host's): bytes held and its capacity,
    # blocks copied into it as they left the device, taken back to the device by a prompt, and
    # forgotten to stay within the capacity.
    prefix_host_bytes: int = 0
    prefix_host_capacity_bytes: int = 0
    prefix_host_out: int = 0
    prefix_host_back: int = 0
    prefix_host_forgotten: int = 0
    # The prefill memory cap (--prefill-memory-cap): steps whose planned prefill work was cut
    # to fit the budget beside the KV held, steps estimated over it anyway (the oldest prompt's
    # next unit alone), and the largest estimate of one step's activations so far.
    prefill_capped_steps: int = 0
    activation_overruns: int = 0
    activation_estimate_peak_bytes: int = 0
    # Finished requests whose conversation (prompt and generated tokens) was kept for its next
    # turn, and the tokens of whole chunks their keep tasks computed again to keep it.
    conversations_kept: int = 0
    conversation_tokens_kept: int = 0
    # Speculative decoding (--speculative): verify steps computed, the draft tokens they checked,
    # those that stood (acceptance rate = accepted / drafted), and the tokens they emitted
    # (tokens per verify step = emitted / steps); and why it is off ("" while it is on or was
    # never asked for): its load check's verdict, or the verify step that failed on the device.
    speculative_steps: int = 0
    speculative_drafted: int = 0
    speculative_accepted: int = 0
    speculative_emitted: int = 0
    speculative_off_reason: str = ""
    # The device thread's time since start by kind of work, as (kind, calls, seconds): a step,
    # building its decode graph, launching it, reading it back, prefill chunks, other jobs; and
    # decode rows counted (seconds 0), so rows per step = decode_rows calls / step calls.
    device_time: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PrefixSummary:
    """What a node's prefix cache holds, for the router: the first bytes of every kept block's key
    (`statecore.routing.summary_key`), blocks of `block_tokens` prompt tokens (0: no prefix
    cache), ending early after a token of `block_ends` (`statecore.prefix.block_bounds`), as of
    `version`."""

    block_tokens: int
    version: int
    keys: tuple[bytes, ...] = ()
    block_ends: tuple[int, ...] = ()


def no_prefix_cache(since: int | None) -> PrefixSummary | None:
    """`Engine.prefix_summary`'s answer from an engine without a prefix cache: an empty summary,
    unchanged since version 0."""
    return None if since == 0 else PrefixSummary(block_tokens=0, version=0)


class Engine(Protocol):
    """A model runtime driven from trio; every method is safe to call from the event loop.

    Errors are raised as `statecore.errors.StatecoreError` with a typed `ErrorInfo`.
    """

    @property
    def info(self) -> ModelInfo: ...

    async def prefill(
        self, request_id: RequestId, prompt: Sequence[int], sampling: SamplingParams,
        segments: SegmentSink | None = None, device_pieces: bool = False,
    ) -> PrefillOutcome:
        """Prefill prompt[:-1] in fixed chunks, then the last token alone; sample the first
        token at position len(prompt). The cache stays held under `request_id`. With `segments`,
        each piece of the cache goes there as soon as it is computed, where the engine can cut
        its cache so (`PrefillOutcome.streamed` says whether it did), and the outcome as soon as
        the first token is known, where the engine can tell it before the last pieces.
        `device_pieces`: the pieces' receiver takes them in GPU memory on this host
        (`ModelInfo.device_pieces`), so a piece may stay there (held until the cache's release)."""
        ...

    async def send_pieces_on_device(self, request_id: RequestId) -> bool:
        """A streamed prefill under way (`prefill(segments=...)`) learns that its receiver takes
        pieces in GPU memory after all, as `device_pieces` says: the pieces not yet handed out may
        stay there. Whether they will (False: no such prefill under way, or this engine sends
        none so)."""
        ...

    async def export_held(self, request_id: RequestId) -> KvPieces:
        """Encode the held cache in the KV wire format. The cache stays held."""
        ...

    async def export_prefix(self, tokens: Sequence[int]) -> KvPieces:
        """The leading whole blocks of `tokens` that the prefix cache holds, in the KV wire format
        (its token count: how many tokens they cover). Only the prefix cache's own blocks, never
        a live request's cache. PREFIX_NOT_CACHED when none is held."""
        ...

    async def import_prefix(self, payload: KvBytes, tokens: Sequence[int]) -> int:
        """Validate a payload of `export_prefix` (this node's fingerprint: the same chunk size)
        over the start of `tokens`, and keep its whole blocks in the prefix cache, so a prompt
        starting with them starts after them. Returns the tokens kept (0: nothing, e.g. no
        prefix cache). Raises on a payload that does not fit; nothing is kept then."""
        ...

    async def release_held(self, request_id: RequestId) -> int:
        """Drop a held cache; returns the bytes freed (0 if none). Idempotent."""
        ...

    async def decode_held(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
    ) -> None:
        """Move a held cache straight into the local decoder (no wire)."""
        ...

    async def install(
        self,
        request_id: RequestId,
        payload: KvBytes,
        prompt: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
    ) -> None:
        """Validate a KV payload fully, then insert it into the running decoder. On any
        error nothing is installed."""
        ...

    async def receive_segment(self, request_id: RequestId, segment: KvSegment, prompt_tokens: int, *,
                              max_tokens: int, index: int | None = None) -> None:
        """Validate one streamed piece of a handed-off cache completely and keep it for
        `install_segments` (raises on any error; nothing is kept then): where the engine can, it
        is written into the room the request will decode in (`max_tokens` sizes that room), so
        that the install copies nothing. Pieces may be received side by side: `index` (0, 1, ...
        in the stream's order) is the order they are kept in, each after every earlier one, none
        after one failed; without it, in the order of the calls (one after another)."""
        ...

    async def install_segments(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        first_token: int,
        sampling: SamplingParams,
        pieces: int | None = None,
    ) -> None:
        """Insert the pieces received for the request into the running decoder, as `install`
        does with a whole payload. With `pieces` (how many were handed to `receive_segment`) it
        may be asked while the last of them are still being checked: it waits until they are
        kept, then installs at once (the decode node's handoff saves a round trip), and raises
        what failed if one of them did."""
        ...

    def stream(self, request_id: RequestId) -> AsyncIterator[Decoded]:
        """The tokens after the first one as the core's events (`statecore.policy.decoded`): each
        value a decode step's tokens (several steps' when the reader is behind), then `Finished`
        when EOS or max_tokens ends the generation; then the iterator ends."""
        ...

    async def cancel(self, request_id: RequestId) -> None:
        """Stop decoding and free everything held for the request. Idempotent."""
        ...

    def statistics(self) -> EngineStatistics: ...

    def liveness(self) -> EngineLiveness:
        """`statistics()`'s `device_thread_alive` and `stalled_s` alone, cheaply (never blocks)."""
        ...

    async def prefix_summary(self, since: int | None = None) -> PrefixSummary | None:
        """The prefix cache's summary, or None when it is unchanged since version `since`."""
        ...

    async def aclose(self) -> None: ...


__all__ = [
    "no_prefix_cache",
    "KvBytes",
    "KvPieces",
    "KvSegment",
    "SegmentSink",
    "Engine",
    "EngineLiveness",
    "EngineStatistics",
    "Decoded",
    "GeneratedToken",
    "LayerTravel",
    "ModelInfo",
    "PrefillOutcome",
    "PrefixSummary",
    "SamplingParams",
]
