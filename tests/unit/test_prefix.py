"""The prefix cache's policy (`statecore.prefix`): block keys name whole chunks before the last
token, and the index keeps whole prefixes only, least recently used out first, within capacity."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from statecore.prefix import PrefixIndex, block_keys


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
    assert index.add(c, b, 100) == [x]
    assert index.nbytes == 300 and index.cached([a, b, c]) == 3
    # a parent is never forgotten before its extensions
    assert index.evict(100) == [c] and index.evict(150) == [b, a] and len(index) == 0
    assert index.add(b, None, 400) == [b]  # larger than the capacity: not kept


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
