"""`models.collective.differing_ranks`: which ranks' digests are not rank 0's, from one all-gather (replaced here by
the ranks' texts), so a refusal names them (train's `check_same_start`, evaluate's `check_same_settings`)."""

from __future__ import annotations

from models import collective


def test_the_ranks_whose_digest_is_not_rank_0s_are_named_per_digest(monkeypatch) -> None:
    texts = ["aa 11", "aa 11", "ab 11", "aa 12"]  # rank 2 differs in the first digest, rank 3 in the second
    monkeypatch.setattr(collective.agree, "gather_texts", lambda world, text: texts)
    assert collective.differing_ranks(4, ["aa", "11"]) == [[2], [3]]
    assert collective.ranks_differ([2]) == "rank 2 differs from rank 0"
    assert collective.ranks_differ([1, 3]) == "ranks 1, 3 differ from rank 0"


def test_one_process_differs_from_nobody() -> None:
    assert collective.differing_ranks(1, ["aa", "bb"]) == [[], []]
