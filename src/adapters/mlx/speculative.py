"""Speculative decoding in the slot lane: draft a few tokens, check them in one verify step, keep
what the target model would have drawn anyway.

When at most `max_rows` requests decode (one by default) and each may speculate (no grammar, no
logits shaping, no logprobs asked for, no LoRA adapter named: the load check below measures the
base model's calls; not `num_draft_tokens` 0), a step first reads the previous step back (a
draft needs the latest token), drafts tokens for each due row (up to the node's
`num_draft_tokens`, or the request's where it asks for fewer) by prompt lookup
(`statecore.speculation.NgramIndex`) or the draft model and, if any, computes one *verify
step*: every row's last token and its drafts as rows of one slot-lane call, all in the row's own
slot at consecutive positions (each row attends its slot up to its own position, so row i sees the
keys the rows before it wrote). A draft stands while it equals
the token the target draws at its position (the argmax; for a seeded row the draw keyed by (seed,
position)), so a request emits the tokens it emits without speculation. Those tokens come from the
verify step's logits, which equal an ordinary step's only when the call's row count picks the same
kernels: `measure` finds at load which row counts compute a row alike
(`statecore.speculation.row_classes`), and a verify step carries only as many drafts as keep it in
the ordinary step's class (`draft_room`); a literal comparison of a verify step with single steps
must pass too, or speculation stays off (logged; a check that raises turns it off as well: the node
serves without it). Rejected drafts' keys lie past the row's position, hidden by the mask and
overwritten by its next steps. A row whose tries keep nothing waits longer before the next
(`SpeculationPace`); while it waits it decodes in the ordinary, overlapped steps.
A request's first verify step is its prompt's last call (`adapters.mlx.first_verify`); a cache
handed off instead is cut back to the prompt. The load check compares that call with the last
token alone and single steps after it (its rows, the last token's keys and values, a step after
them), or the last token goes alone.
This module imports mlx and mlx_lm; never trio, never the engine nor the device loop (its caller,
seen here only as a `SpeculationHost`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import greedy_sampler

from adapters.mlx.jobs import engine_failed
from adapters.mlx.prefill import PrefillTask
from adapters.mlx.rows import LaneHost
from adapters.mlx.sampling import log_softmax, sample
from adapters.mlx.speculation_probes import load_check
from statecore.errors import StatecoreError
from statecore.speculation import NgramIndex, SpeculationPace, draft_room, kept_drafts

if TYPE_CHECKING:
    from adapters.mlx.draft_model import DraftModel
    from adapters.mlx.rows import Live

__all__ = ["SpeculationHost", "Speculator"]

logger = logging.getLogger("adapters.engine_mlx")


class SpeculationHost(LaneHost, Protocol):
    """What speculation needs of the device loop beside what a lane does."""

    pipelined: bool
    live: Mapping[str, Live]  # the requests in the decoder
    gathering: Mapping[str, Live]  # choices of n > 1 waiting for their siblings
    requests: Any  # every request the loop knows (`in` by request id)

    def slot_tokens_in_flight(self) -> bool:
        """Whether the step on the device now decodes slot rows (its tokens not read back yet)."""
        ...

    def read_back_now(self) -> None:
        """Read the step on the device back now, before the next is built."""
        ...

    def slot_inputs_on_host(self) -> None:
        """Every slot row's next input is its host token (the device's last tokens are stale)."""
        ...

    def staged_lost(self, error: StatecoreError) -> list[Live]:
        """The pool's buffers were emptied: the handoffs staged there lose their pieces (their next
        piece or install raises `error`); those already joined are returned, to fail."""
        ...


@dataclass(eq=False)
class _Row:
    """A request's speculation state: its tokens so far (the prompt by reference, then what it
    generated), the n-gram index built from them once it first tries, and its pace."""

    prompt: Sequence[int]
    generated: list[int] = field(default_factory=list)
    index: NgramIndex | None = None
    pace: SpeculationPace = field(default_factory=SpeculationPace)

    @property
    def history(self) -> list[int]:
        return [*self.prompt, *self.generated]


class Speculator:
    """The device thread's speculation (one per `DeviceLoop`, when `--speculative` is not off)."""

    def __init__(self, mode: str, num_draft_tokens: int, max_rows: int,
                 draft: DraftModel | None = None) -> None:
        self.mode = mode
        self.num_draft_tokens = num_draft_tokens
        self.max_rows = max_rows
        self.draft = draft  # mode "draft": the draft model guesses; else prompt lookup
        self.rows: dict[str, _Row] = {}
        self.classes: tuple[int, ...] = ()
        self.off_reason: str | None = None
        self.first_room = 0  # drafts a prompt's last call may carry (0: the last token goes alone)
        # verify steps computed, draft tokens they checked, drafts that stood, tokens emitted
        self.verify_steps = self.drafted = self.accepted = self.emitted = 0
        self.early_reads = 0  # steps that read the previous one back before building (a try)
        self.verifying = False  # a verify step's model call is being built (a test hook reads it)
        # A verify step's tokens, held until the next verify step's computation starts (`hold`).
        self.held: tuple[SpeculationHost, dict[Any, list[Any]]] | None = None

    # -- at load -------------------------------------------------------------------------------

    def measure(self, loop: SpeculationHost) -> None:
        """The load check (`adapters.mlx.speculation_probes.load_check`): which row counts compute
        a row alike, how many drafts a prompt's last call may carry, or why speculation is off."""
        found = load_check(loop, loop.pipelined, self.mode, self.max_rows, self.num_draft_tokens, self.draft)
        self.classes, self.first_room, self.off_reason = found.classes, found.first_room, found.off_reason

    # -- rows ----------------------------------------------------------------------------------

    def joined(self, live: Live, prompt: Sequence[int]) -> None:
        self.rows[live.request_id] = _Row(prompt, [live.last_token])

    def took(self, live: Live, token: int) -> None:
        row = self.rows.get(live.request_id)
        if row is None:
            return
        row.generated.append(token)
        if row.index is not None:
            row.index.extend((token,))

    def left(self, request_id: str) -> None:
        """A request left the decoder, or will never join it (its held cache went, or its prompt
        failed): its row and its draft model cache go (tokens held for it go out first, ahead of
        whatever ends it)."""
        self.hand_out_held()
        self.rows.pop(request_id, None)
        if self.draft is not None:
            self.draft.forget(request_id)

    # -- the prompt's last call: a request's first verify step -----------------------------------

    def first_verified(self, task: PrefillTask, first: int) -> tuple[int, ...]:
        """A prompt's last call that carried drafts was read back (its first token `first`): the
        tokens it emits, the first one first (those after it are the drafts that stood, then the
        target's draw after them); its cache is cut back to the prompt and the drafts that stood."""
        assert task.cache is not None
        drafts: list[int] = task.drafts.tolist()
        drawn = [first, *task.drawn.tolist()]
        kept = kept_drafts(drafts, drawn)
        for layer in task.cache:
            layer.trim(len(drafts) - kept)
        task.drafts = task.drawn = None
        if self.draft is not None:
            self.draft.drafted(task.request_id, drafts)
        self.verify_steps += 1
        self.drafted += len(drafts)
        self.accepted += kept
        self.emitted += 1  # the first token; the others as they are handed out (`verified_items`)
        return tuple(drawn[: kept + 1])

    def forget_gone(self, loop: SpeculationHost) -> None:
        """Draft model caches of requests the loop no longer knows (a prompt that failed after its
        last call drafted) go."""
        if self.draft is not None:
            for request_id in [rid for rid in self.draft.rows if rid not in loop.requests]:
                self.draft.forget(request_id)

    @staticmethod
    def eligible(live: Live) -> bool:
        sampler = live.sampler
        sampling = sampler.sampling
        return (live.slot is not None and not live.staging and sampler.constraint is None
                and not sampling.shapes_logits and sampling.logprobs is None and sampling.adapter is None
                and sampling.num_draft_tokens != 0)

    # -- a step --------------------------------------------------------------------------------

    def step(self, loop: SpeculationHost, rows: list[Live]) -> list[Live]:
        """Speculate for `rows` (the slot lane's) when they may; returns the rows the ordinary
        step still decodes (none when a verify step computed them)."""
        due = (self.off_reason is None and 0 < len(rows) == len(loop.live) <= self.max_rows
               and not loop.gathering and all(self.eligible(live) for live in rows)
               and all(live.request_id in self.rows for live in rows)
               and any(self.rows[live.request_id].pace.due for live in rows))
        if not due:
            self.hand_out_held()
            self.pass_step(rows)
            return rows
        if loop.slot_tokens_in_flight():
            # Drafts continue from the latest token, still on the device: read it back now, unless
            # no draft could follow it anyway (the overlap of this step is kept then).
            if not any(self.rows[live.request_id].pace.due
                       and (self.draft is not None or self.index(live).may_draft_next()) for live in rows):
                self.hand_out_held()
                self.pass_step(rows)
                return rows
            self.early_reads += 1
            loop.read_back_now()
            rows = [live for live in loop.live.values() if live.slot is not None]
            if not rows or len(rows) != len(loop.live):
                return rows
        pool = loop.pool
        assert pool is not None
        reference = pool.rows([live.slot for live in rows if live.slot is not None])
        room = draft_room(self.classes, reference, len(rows), self.num_draft_tokens * len(rows))
        drafts = self.propose(rows, room)
        if not any(_count(draft) for draft in drafts):
            self.hand_out_held()
            for live in rows:
                self.tried(live, 0)
            return rows
        try:
            self.verify(loop, rows, drafts)
        except Exception as exc:
            return self.verify_raised(loop, rows, exc)
        return []

    def verify_raised(self, loop: SpeculationHost, rows: list[Live], exc: Exception) -> list[Live]:
        """After a verify step raised. Raised while its graph was built (before the device ran
        any of it), the ordinary step decodes the rows instead (a transient error costs a token's
        time) and they wait a while before the next try. Raised on the device, the pool's
        buffers are lost: their lazy updates raise again in every later step, or (where the
        failed kernel ran on another stream) read back whatever the failure left. A verify step
        runs only while its rows are all that decode, so its rows fail, the buffers start again
        empty, and speculation turns off (a kernel that failed once on these shapes fails again)."""
        self.hand_out_held()
        for live in rows:
            self.tried(live, 0)
            if self.draft is not None:  # its cache may hold drafts whose values never came back
                self.draft.forget(live.request_id)
        loop.slot_inputs_on_host()
        if not isinstance(exc, _FailedOnDevice):
            logger.warning("a verify step raised (%s: %s); decoding one token instead",
                           type(exc).__name__, exc)
            return [live for live in loop.live.values() if live.slot is not None]
        raised = exc.raised
        pool = loop.pool
        assert pool is not None
        pool.empty_buffers()
        self.off_reason = f"a verify step failed on the device ({type(raised).__name__}: {raised})"
        logger.warning("speculative decoding is off: %s; its %d requests failed", self.off_reason, len(rows))
        deliveries: dict[Any, list[Any]] = {}
        for live in rows:
            if loop.live.get(live.request_id) is live:
                loop.fail_alone(live, raised, deliveries)
        # Handoffs staged in the pool lost what was written there: they fail, typed, rather than
        # decode from the emptied buffers.
        lost = engine_failed(f"its KV was in the slot pool, which a verify step that failed on the device "
                             f"left unusable ({type(raised).__name__}: {raised})")
        for live in loop.staged_lost(lost):
            if loop.live.get(live.request_id) is live:
                loop.end(live, lost, deliveries)
        loop.hand_out(deliveries)
        return [live for live in loop.live.values() if live.slot is not None]

    def pass_step(self, rows: Sequence[Live]) -> None:
        for live in rows:
            row = self.rows.get(live.request_id)
            if row is not None:
                row.pace = row.pace.stepped()

    def tried(self, live: Live, kept: int) -> None:
        row = self.rows.get(live.request_id)
        if row is not None:
            row.pace = row.pace.tried(kept)

    def index(self, live: Live) -> NgramIndex:
        """The row's n-gram index, built from its tokens so far when first asked for."""
        row = self.rows[live.request_id]
        if row.index is None:
            row.index = NgramIndex(tokens=row.history)
        return row.index

    def propose(self, rows: Sequence[Live], room: int) -> list[Any]:
        """Each due row's drafts, within `room` tokens in all; never past a row's last token: a
        list of token ids (prompt lookup), or a lazy array of them (a draft model's)."""
        drafts: list[Any] = []
        for live in rows:
            row = self.rows[live.request_id]
            asked = live.sampler.sampling.num_draft_tokens  # the request's own cap, under the node's
            most = self.num_draft_tokens if asked is None else min(asked, self.num_draft_tokens)
            wanted = min(most, room, live.remaining - 1)
            if not row.pace.due or wanted <= 0:
                drafts.append([])
                continue
            if self.draft is not None:
                with mx.stream(generation_stream):  # the verify step's stream: no wait between them
                    proposed = self.draft.propose(live.request_id, row.prompt, row.generated, wanted,
                                                  live.sampler)
            else:
                proposed = self.index(live).draft(wanted)
            room -= _count(proposed)
            drafts.append(proposed)
        return drafts

    def verify(self, loop: SpeculationHost, rows: list[Live], proposed: list[Any]) -> None:
        """One verify step over `rows` and their drafts, computed now; each row gets the tokens
        that stood and the one drawn after them."""
        pool = loop.pool
        assert pool is not None
        pieces: list[Any] = []
        offsets: list[int] = []
        slots: list[int] = []
        for live, draft in zip(rows, proposed, strict=True):
            assert live.slot is not None
            pieces += [mx.array([live.last_token], dtype=mx.uint32),
                       mx.array(draft, dtype=mx.uint32) if isinstance(draft, list) else draft]
            for i in range(1 + _count(draft)):
                offsets.append(live.offset + i)
                slots.append(live.slot)
        with mx.stream(generation_stream):
            loop.computing = ("decode", [live.request_id for live in rows])
            layers = pool.step_layers(offsets, slots, bucket=loop.bucket)
            self.verifying = True
            try:
                logits = loop.model(mx.concatenate(pieces)[:, None], cache=layers)[:, -1, :]
            finally:
                self.verifying = False
                loop.computing = ("", ())
            drawn = _draw(logits, rows, [_count(draft) for draft in proposed])
            self.hand_out_held()
            try:
                if self.draft is not None:
                    mx.async_eval(drawn, pieces, pool.keys, pool.values)  # type: ignore[no-untyped-call]
                    self.draft_ahead(rows, proposed)
                mx.eval(drawn, pieces, pool.keys, pool.values)
            except Exception as exc:
                raise _FailedOnDevice(exc) from exc
        tokens: list[int] = drawn.tolist()
        drafts = [draft if isinstance(draft, list) else draft.tolist() for draft in proposed]
        if self.draft is not None:
            for live, draft in zip(rows, drafts, strict=True):
                self.draft.drafted(live.request_id, draft)
        loop.slot_inputs_on_host()
        deliveries: dict[Any, list[Any]] = {}
        start = 0
        self.verify_steps += 1
        ended = False
        for live, draft in zip(rows, drafts, strict=True):
            mine = tokens[start : start + len(draft) + 1]
            start += len(draft) + 1
            kept = kept_drafts(draft, mine)
            self.drafted += len(draft)
            self.accepted += kept
            self.tried(live, kept if draft else 0)
            live.fed = False
            if not live.sampler.plain_greedy:
                live.sampler.position += kept + 1
            for token in mine[: kept + 1]:
                self.emitted += 1
                live.offset += 1
                live.last_token = token
                if loop.hand_token(live, loop.count_token(live, token), deliveries):
                    ended = True
                    break
        if ended:
            loop.hand_out(deliveries)
        else:
            self.held = (loop, deliveries)

    def draft_ahead(self, rows: Sequence[Live], proposed: Sequence[Any]) -> None:
        """With a verify step launched: each of its rows' next drafts, drawn as if all its drafts
        stand and the target draws after them what the draft model does
        (`adapters.mlx.draft_model.DraftModel.draft_ahead`), so that where they do the next verify
        step starts without waiting for the draft model. Only for a row that will draft again
        after this step (as many drafts as now, within what it may still emit)."""
        assert self.draft is not None
        for live, draft in zip(rows, proposed, strict=True):
            checked = _count(draft)
            after = live.remaining - checked - 1  # what it may still emit if every draft stands
            count = min(checked, after - 1)
            if checked and count > 0:
                self.draft.draft_ahead(live.request_id, draft[-1:], count, live.sampler, checked)

    def hand_out_held(self) -> None:
        """The tokens of the last verify step, if they are still held: a step whose rows all go on
        holds its tokens until the next one's computation starts, since handing them out wakes
        the event loop, whose work on them (the responses' text and writes) would otherwise
        share the interpreter with the next step's drafts and build; while the device computes,
        the interpreter is free. A row that ends, any step that is not the next verify step, a
        row leaving and a failure hand them out first."""
        held, self.held = self.held, None
        if held is not None:
            loop, deliveries = held
            loop.hand_out(deliveries)


class _FailedOnDevice(Exception):
    """A verify step that raised while the device computed it (not while it was built)."""

    def __init__(self, raised: Exception) -> None:
        super().__init__(str(raised))
        self.raised = raised


def _count(draft: Any) -> int:
    """How many tokens a row's drafts hold (a list, or a lazy array)."""
    return len(draft) if isinstance(draft, list) else int(draft.shape[0])


def _draw(logits: Any, rows: Sequence[Live], counts: Sequence[int]) -> Any:
    """The token each verify row's target draws, as `sample_rows` draws it in an ordinary step:
    greedy rows the argmax of the log-probabilities, seeded rows with their position's key."""
    greedy = greedy_sampler(log_softmax(logits))
    if all(live.sampler.plain_greedy for live in rows):
        return greedy
    parts = []
    start = 0
    for live, count in zip(rows, counts, strict=True):
        sampler = live.sampler
        for i in range(count + 1):
            row = start + i
            if sampler.plain_greedy:
                parts.append(greedy[row : row + 1])
            else:
                parts.append(sample(log_softmax(logits[row : row + 1]), sampler.sampling, sampler.seed,
                                    sampler.position + i))
        start += count + 1
    return mx.concatenate(parts, axis=0)
