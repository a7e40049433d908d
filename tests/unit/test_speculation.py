"""`statecore.speculation`: prompt lookup's drafts, a verify step's room, what stands, the pace."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statecore.speculation import (
    MAX_PAUSE,
    NgramIndex,
    SpeculationPace,
    draft_room,
    kept_drafts,
    prompt_draft,
    row_classes,
)


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex(max_n=3, min_n=1, tokens=[1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    assert index.draft(3) == [4, 9, 2]  # the longest suffix, "1 2 3", rather than the later "2 3"
    index = NgramIndex(max_n=3, min_n=1, tokens=[1, 2, 3, 4, 9, 8, 2, 3, 5, 7, 0, 2, 3])
    assert index.draft(2) == [5, 7]  # "0 2 3" never occurred; "2 3" last occurred before 5 7


def test_the_suffix_itself_is_not_an_earlier_occurrence() -> None:
    index = NgramIndex(max_n=2, min_n=2, tokens=[5, 6, 7])
    assert index.draft(4) == []
    index.extend([5, 6])
    assert index.draft(4) == [7, 5, 6, 7]  # what followed the first "5 6", copied on
    index.extend([8])
    assert index.draft(4) == []


def test_a_repeating_row_drafts_its_own_period() -> None:
    index = NgramIndex(max_n=3, min_n=2)
    index.extend([1, 2, 1, 2, 1, 2])
    assert index.draft(5) == [1, 2, 1, 2, 1]  # the copy runs on into what it copied
    assert index.draft(0) == []


def test_ngram_sizes_are_checked() -> None:
    with pytest.raises(ValueError):
        NgramIndex(max_n=1, min_n=2)


def test_row_classes_group_counts_that_compute_alike() -> None:
    # counts 1-2 alike, 3-4 alike, 5 alone
    same = [[a == b or {a, b} in ({0, 1}, {2, 3}) for b in range(5)] for a in range(5)]
    assert row_classes(same) == (1, 1, 3, 3, 5)


def test_a_verify_step_stays_in_the_ordinary_step_s_class() -> None:
    classes = (1, 1, 3, 3, 3, 3)
    assert draft_room(classes, 1, 1, 4) == 1  # a lone row: two rows at most
    assert draft_room(classes, 3, 1, 4) == 4  # a row in slot 2: five rows (counts 3..6 alike)
    assert draft_room(classes, 3, 1, 9) == 5  # no further than the counts measured
    assert draft_room(classes, 7, 1, 4) == 0  # an ordinary step's count never measured
    assert draft_room((1, 2, 3), 1, 1, 2) == 0  # every count computes differently: no drafts
    assert draft_room((1,) * 8, 2, 2, 3) == 3


def test_drafts_stand_while_they_equal_what_the_target_drew() -> None:
    assert kept_drafts([4, 5, 6], [4, 5, 7, 8]) == 2
    assert kept_drafts([4, 5, 6], [4, 5, 6, 1]) == 3
    assert kept_drafts([4, 5, 6], [3, 5, 6, 1]) == 0
    assert kept_drafts([], [3]) == 0


def test_a_failing_row_waits_ever_longer_and_a_success_resets_it() -> None:
    pace = SpeculationPace()
    assert pace.due
    waits = []
    for _ in range(7):
        pace = pace.tried(0)
        waits.append(pace.wait)
        while not pace.due:
            pace = pace.stepped()
    assert waits == [1, 2, 4, 8, 16, 16, 16]
    assert max(waits) == MAX_PAUSE
    assert pace.tried(2) == SpeculationPace()


def test_a_row_may_draft_after_its_next_token_only_if_its_last_token_came_before() -> None:
    index = NgramIndex(max_n=3, min_n=2, tokens=[4, 5, 6])
    assert not index.may_draft_next()  # 6 never came before: no bigram "6 x" can have
    index.extend([5])
    assert index.may_draft_next()  # 5 came before (followed by 6)
    assert NgramIndex(max_n=2, min_n=1, tokens=[1]).may_draft_next()


@given(st.lists(st.integers(0, 4), max_size=40), st.integers(0, 6), st.integers(1, 3), st.integers(0, 2))
def test_a_prompt_s_draft_is_its_index_s(tokens: list[int], count: int, min_n: int, more: int) -> None:
    """The search a prompt's last call drafts with finds what the row's index drafts (a small
    alphabet: many earlier occurrences, overlapping ones; and tokens of one set byte each, whose
    bytes hold other tokens' across token boundaries: [0x01000000, 0x01000000, 0] holds [1, 1])."""
    max_n = min_n + more
    assert prompt_draft(tokens, count, max_n, min_n) == NgramIndex(max_n, min_n, tokens).draft(count)
    shifted = [0 if token == 0 else 1 << 8 * (token - 1) for token in tokens]
    assert prompt_draft(shifted, count, max_n, min_n) == NgramIndex(max_n, min_n, shifted).draft(count)
