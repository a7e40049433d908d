"""The prefix cache's policy (`statecore.prefix`): block keys name whole chunks before the last
token, and the index keeps whole prefixes only, least recently used out first, within capacity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.prefix import (
    LONG,
    MESSAGE_BLOCKS,
    Moved,
    PrefixIndex,
    block_bounds,
    block_keys,
    conversation_block_bounds,
    conversation_block_keys,
    conversation_blocks,
    prompt_chunks,
)
from statecore.scheduling import prefill_chunks


def test_a_block_is_a_whole_chunk_before_the_last_token_named_by_everything_before_it() -> None:
    tokens = list(range(50))
    keys = block_keys(tokens, 16)
    assert len(keys) == 3  # ends at 16, 32, 48; the last token (49) is always computed
    assert block_keys(list(range(48)), 16) == keys[:2]  # 48 tokens: the block ending at 48 holds the last
    assert block_keys(list(range(49)), 16) == keys  # ... but with 49 it is
    other = [*range(16), 99, *range(17, 50)]  # one token of block 2 differs: blocks 2 and 3 differ
    assert block_keys(other, 16)[0] == keys[0] and set(block_keys(other, 16)[1:]).isdisjoint(keys)
    assert block_keys([1, 2, 3], 16) == []


def test_the_least_recently_used_leaf_goes_first_and_a_prefix_stays_whole() -> None:
    index = PrefixIndex(capacity_bytes=300)
    a, b, c = block_keys(list(range(49)), 16)
    assert index.add(a, None, 100) == [] and index.add(b, a, 100) == []
    x = block_keys([7] * 17, 16)[0]
    assert index.add(x, None, 100) == []
    assert index.cached([a, b, c]) == 2  # a and b now the most recent: x is the oldest leaf
    assert index.add(c, b, 100) == [Moved(x, None)]  # no host tier: forgotten
    assert index.nbytes == 300 and index.cached([a, b, c]) == 3
    # a parent is never forgotten before its extensions
    assert index.evict(100) == [Moved(c, None)]
    assert index.evict(150) == [Moved(b, None), Moved(a, None)] and len(index) == 0
    assert index.add(b, None, 400) == [Moved(b, None)]  # larger than the capacity: not kept


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(10, 120)), max_size=60),
       st.integers(100, 400))
def test_random_use_never_exceeds_capacity_nor_keeps_an_orphan(ops: list[tuple[int, int, int]],
                                                               capacity: int) -> None:
    index = PrefixIndex(capacity)
    prompts = [block_keys([p] * (16 * 6 + 1), 16) for p in range(4)]
    for prompt, depth, size in ops:
        keys = prompts[prompt][:depth]
        have = index.cached(keys)
        for i in range(have, len(keys)):
            index.add(keys[i], keys[i - 1] if i else None, size)
            if keys[i] not in index:
                break
        if size > 100:
            index.evict(size)
        assert index.nbytes <= capacity
        for chain in prompts:  # what is kept of a prompt is always its first blocks
            kept = [key in index for key in chain]
            assert kept == sorted(kept, reverse=True)


def test_a_conversations_keys_take_its_last_whole_chunk_and_extend_its_prompts() -> None:
    conversation = list(range(48))
    keys = conversation_block_keys(conversation, 16)
    assert len(keys) == 3  # ends at 16, 32 and 48: a next turn goes on after token 47
    assert keys == block_keys([*conversation, 99], 16)
    assert keys[:2] == block_keys(conversation, 16)  # the prompt's own stop before its last token
    assert conversation_block_keys(list(range(15)), 16) == []


@pytest.mark.parametrize(("prompt", "conversation", "cached", "expected"), [
    (40, 72, 2, range(2, 4)),  # the prompt's two blocks cached: compute the ones ending at 48, 64
    (40, 72, 4, range(4, 4)),  # all kept already
    (40, 72, 1, range(0)),  # a prompt block forgotten: keeping would be the prompt's prefill again
    (10, 40, 0, range(0, 2)),  # a short prompt has no block of its own: the whole conversation
    (17, 17, 1, range(1, 1)),  # nothing generated past a whole chunk
    (33, 64, 2, range(2, 4)),
])
def test_a_conversation_keeps_the_chunks_after_its_prompts_cached_blocks(
    prompt: int, conversation: int, cached: int, expected: range
) -> None:
    assert conversation_blocks(prompt, conversation, cached, 16) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 500), st.integers(0, 500), st.integers(0, 40), st.integers(1, 64))
def test_keeping_never_recomputes_a_prompt_nor_goes_past_the_conversation(
    prompt: int, generated: int, cached: int, chunk: int
) -> None:
    conversation = prompt + generated
    blocks = conversation_blocks(prompt, conversation, cached, chunk)
    if blocks:
        assert blocks.start == cached >= (prompt - 1) // chunk  # every prompt block is cached
        assert blocks.stop * chunk <= conversation
        assert len(blocks) * chunk <= generated + chunk  # the tail: at most a chunk beyond the answer


def test_conversation_blocks_refuses_a_chunk_of_nothing() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        conversation_blocks(10, 20, 0, 0)


END = 0  # a message's last token in these tests


def test_a_block_also_ends_after_a_message_end_and_the_blocks_go_on_from_there() -> None:
    tokens = [*range(1, 21), END, *range(30, 60), END, *range(70, 80)]  # messages end at 21 and 52
    # not at 52: the prompt's last message end (the message just sent, computed with what follows)
    assert block_bounds(tokens, 16, {END}) == [16, 21, 37, 53]
    assert prompt_chunks(tokens, 16, {END}) == (16, 5, 16, 16, 8, 1)
    assert block_bounds(tokens, 16) == [16, 32, 48]  # without ends: every 16 tokens
    # the same tokens cut elsewhere are other blocks: no key in common after the first cut
    assert block_keys(tokens, 16, {END})[0] == block_keys(tokens, 16)[0]
    assert set(block_keys(tokens, 16, {END})[1:]).isdisjoint(block_keys(tokens, 16))
    # the rule before cut at every message end, in prompts past one chunk only
    assert block_bounds(tokens, 16, {END}, rule=LONG) == [16, 21, 37, 52]


def test_a_prompt_shorter_than_a_chunk_is_cut_at_its_message_ends_but_the_last() -> None:
    """A first turn on a shared system prompt, at 2,048-token chunks: the system message is a
    block of its own, the same one a longer prompt or a kept conversation cuts; the user message
    goes with the assistant's header into one call."""
    tokens = [1, 2, END, 3, 4, END, 5, 6]
    assert prompt_chunks(tokens, 16, {END}) == (3, 4, 1)
    assert block_bounds(tokens, 16, {END}) == [3]
    assert block_keys(tokens, 16, {END}) == conversation_block_keys(tokens[:3], 16, {END})
    # kept as a conversation, or as the start of its next turn, it is cut at the user message too
    assert conversation_block_bounds(tokens, 16, {END}) == [3, 6]
    assert block_bounds([*tokens, 7, END, 8], 16, {END}) == [3, 6]
    # a prompt of one message is one call (and may share a padded call with other short prompts)
    assert prompt_chunks([1, 2, END, 5, 6], 16, {END}) == (4, 1)


def test_the_rule_before_cuts_a_prompt_of_one_chunk_nowhere() -> None:
    tokens = [1, 2, END, 3, 4, END, 5, 6]
    assert prompt_chunks(tokens, 16, {END}, rule=LONG) == (7, 1)  # computed with other short prompts
    assert block_bounds(tokens, 16, {END}, rule=LONG) == []
    assert block_keys(tokens, 16, {END}, rule=LONG) == []
    longer = [*tokens, *range(10, 30)]  # past one chunk: cut at every message end
    assert block_bounds(longer, 16, {END}, rule=LONG) == [3, 6, 22]
    assert block_bounds(longer, 16, {END}) == [3, 19]  # 6: its last message end


def test_a_system_prompt_s_blocks_are_the_same_in_every_prompt_that_starts_with_it() -> None:
    system = [*range(1, 41), END]  # a 41-token system message
    first = block_keys([*system, *range(100, 130), END, 7, 8], 16, {END})  # a user message, a header
    second = block_keys([*system, *range(200, 260), END, 7, 8], 16, {END})
    assert first[:3] == second[:3]  # blocks ending at 16, 32 and 41: the whole system prompt
    assert first[3] != second[3]
    assert conversation_block_keys(system, 16, {END}) == first[:3]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=120), st.lists(st.integers(0, 5), max_size=40),
       st.integers(1, 24))
def test_cuts_depend_only_on_the_tokens_before_them(tokens: list[int], more: list[int], chunk: int) -> None:
    """What makes a kept block usable by a longer prompt: the chunks cover the prompt, one call
    at most `chunk` long, then the last token alone; a prompt's cuts before its last message end
    are any longer prompt's; a kept conversation's cuts are those of a next turn that sends
    another message. With rule LONG, a prompt of more than one chunk is cut as its start is."""
    for rule in MESSAGE_BLOCKS:
        chunks = prompt_chunks(tokens, chunk, {END}, rule=rule)
        assert sum(chunks) == len(tokens) and chunks[-1] == 1
        assert all(0 < size <= chunk for size in chunks[:-1])
        assert prompt_chunks(tokens, chunk, rule=rule) == prefill_chunks(len(tokens), chunk)
    bounds = block_bounds(tokens, chunk, {END})
    longer = block_bounds([*tokens, *more], chunk, {END})
    last_end = max((p for p, token in enumerate(tokens[:-1], 1) if token == END), default=0)
    assert [b for b in bounds if b < last_end] == [b for b in longer if b < last_end]
    next_turn = [*tokens, *more, END, 9]  # the conversation so far, then a message of its own
    kept = conversation_block_bounds(tokens, chunk, {END})
    assert block_bounds(next_turn, chunk, {END})[: len(kept)] == kept
    assert block_keys(next_turn, chunk, {END})[: len(kept)] == conversation_block_keys(tokens, chunk, {END})
    bounds = block_bounds(tokens, chunk, {END}, rule=LONG)
    if len(tokens) - 1 > chunk:
        longer = block_bounds([*tokens, *more], chunk, {END}, rule=LONG)
        assert longer[: len(bounds)] == bounds
        if bounds:  # a prompt's blocks are those of its start kept as a conversation
            assert conversation_block_bounds(tokens[: bounds[-1]], chunk, {END}) == bounds


def _cut_token_by_token(tokens: list[int], head: int, chunk: int, ends: set[int], skip: int = 0) -> list[int]:
    """Block ends as the rule says them, one token at a time: after a token of `ends` (not the one
    ending at `skip`), or `chunk` tokens after the previous end."""
    bounds, start = [], 0
    for position, token in enumerate(tokens[:head], 1):
        if (token in ends and position != skip) or position - start == chunk:
            bounds.append(position)
            start = position
    return bounds


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 6), min_size=1, max_size=80), chunk=st.integers(1, 12),
       ends=st.sets(st.integers(0, 6), max_size=3), rule=st.sampled_from(MESSAGE_BLOCKS))
def test_block_ends_are_found_as_the_token_by_token_rule_finds_them(tokens: list[int], chunk: int,
                                                                   ends: set[int], rule: str) -> None:
    head = len(tokens) - 1
    if rule == LONG:
        expected = _cut_token_by_token(tokens, head, chunk, ends if head > chunk else set())
    else:
        last = max((p for p, token in enumerate(tokens[:head], 1) if token in ends), default=0)
        expected = _cut_token_by_token(tokens, head, chunk, ends, skip=last)
    assert block_bounds(tokens, chunk, ends, rule=rule) == expected  # type: ignore[arg-type]
    assert block_bounds(tuple(tokens), chunk, ends, rule=rule) == expected  # type: ignore[arg-type]
    whole = _cut_token_by_token(tokens, len(tokens), chunk, ends)
    assert conversation_block_bounds(tokens, chunk, ends) == whole
