"""A request's first verify step is its prompt's last call, as mlx-lm's speculative loop does it:
the prompt's last token and the drafts (from the prompt, or the draft model) in one call on the
prompt's own cache, whose row 0 gives the first token (`FirstVerify`, the
`adapters.mlx.prefill.LastCallDrafts` a prefill's last unit asks). The tokens that stood wait with
the held cache for its decode (`Held.drawn`) and leave as stream items counted as the decoder
counts its tokens (`verified_items`). Whether this call may carry drafts at all is the load check's
(`Speculator.first_room`). This module imports mlx and mlx_lm; never trio, never the engine nor the
device loop (seen here only as a `SpeculationHost`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import greedy_sampler

from adapters.mlx.prefill import PrefillTask
from adapters.mlx.sampling import log_softmax, sample
from adapters.mlx.speculative import SpeculationHost, Speculator
from effects.engine_port import GeneratedToken, SamplingParams
from statecore.policy import token_finish
from statecore.speculation import prompt_draft

__all__ = ["FirstVerify", "first_verify", "verified_items"]


def first_verify(speculator: Speculator | None, loop: SpeculationHost) -> FirstVerify | None:
    """What lets a prompt's last call carry drafts on this node now (None: it never does)."""
    if speculator is None or speculator.off_reason is not None or speculator.first_room == 0:
        return None
    return FirstVerify(speculator, loop)


class FirstVerify:
    """A prompt's last call as its request's first verify step (`adapters.mlx.prefill.LastCallDrafts`):
    it carries drafts where the request will speculate, as a lone row would in a verify step: where
    the loop knows no more requests than speculate together (`max_rows`, this one counted), not
    only decoding ones, since prompts prefilled beside it, or held until their first token is
    written (`effects.runner.NodeRunner.join_after_first_read`), join the decoder with it."""

    def __init__(self, speculator: Speculator, loop: SpeculationHost) -> None:
        self.speculator = speculator
        self.loop = loop

    def drafts(self, task: PrefillTask) -> Any | None:
        speculator, loop = self.speculator, self.loop
        sampler = task.sampler
        sampling = sampler.sampling
        if (task.segment_sink is not None or len(task.tokens) < 2 or task.cache is None
                or sampler.constraint is not None or sampling.shapes_logits or sampling.logprobs is not None
                or sampling.adapter is not None or sampling.choices > 1
                or len(loop.requests) > speculator.max_rows or loop.gathering
                or not all(type(layer) is KVCache for layer in task.cache)):
            return None
        asked = sampling.num_draft_tokens
        most = speculator.num_draft_tokens if asked is None else min(asked, speculator.num_draft_tokens)
        wanted = min(most, speculator.first_room, sampling.max_tokens - 1)
        if wanted <= 0:
            return None
        speculator.forget_gone(loop)
        if speculator.draft is not None:
            drafted: Any = speculator.draft.propose(task.request_id, task.tokens, [], wanted, sampler)
            return drafted
        found = prompt_draft(task.tokens, wanted)  # the row's index's draft, without building it
        return mx.array(found, dtype=mx.uint32) if found else None

    def draws(self, task: PrefillTask, logits: Any) -> Any:
        """As `_draw` for the rows after a verify step's first: the first token was drawn already
        (the sampler's position is the next one's)."""
        sampler = task.sampler
        if sampler.plain_greedy:
            return greedy_sampler(log_softmax(logits))
        return mx.concatenate([sample(log_softmax(logits[i : i + 1]), sampler.sampling, sampler.seed,
                                      sampler.position + i) for i in range(logits.shape[0])])


def verified_items(after_first: Sequence[int], sampling: SamplingParams, eos: Collection[int]
                   ) -> list[GeneratedToken]:
    """The stream items of the tokens a prompt's last call verified after the first one, counted
    as the decoder counts its tokens (`statecore.policy.token_finish`): the one that ends the
    request, if any, is the last."""
    items: list[GeneratedToken] = []
    remaining = sampling.max_tokens - 1
    for token in after_first:
        remaining -= 1
        finish = token_finish(token, eos, ignore_eos=sampling.ignore_eos, remaining=remaining)
        items.append(GeneratedToken(token, finish_reason=finish))
        if finish is not None:
            break
    return items
