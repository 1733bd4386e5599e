"""Answer scoring and reply parsing for the search task: no substring credit, linear parsing."""

from __future__ import annotations

import time

import pytest

from envs.search.env import first_action
from envs.search.metrics import exact_match, f1_score, normalize_answer


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  a   Quick\tbrown  fox. ", "quick brown fox"),
        ("An apple, the pear", "apple pear"),
        ("U.S.A.", "usa"),
        ("«Zürich»", "zürich"),
        (".", ""),
        ("the", ""),
    ],
)
def test_normalize_answer_strips_case_punctuation_articles_and_spaces(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_exact_match_accepts_any_gold_after_normalisation() -> None:
    assert exact_match("the Nile", ["Amazon", "Nile"]) == 1.0
    assert exact_match("NILE.", "nile") == 1.0


@pytest.mark.parametrize("pred", [".", "", "   ", "the", "Nil", "Nile River", "Amazon"])
def test_exact_match_gives_no_credit_for_empty_substring_or_wrong(pred: str) -> None:
    assert exact_match(pred, ["Nile"]) == 0.0


def test_f1_is_token_overlap_and_zero_for_empty() -> None:
    assert f1_score("Nile River", ["Nile"]) == pytest.approx(2 / 3)
    assert f1_score("Nile", ["Amazon", "the Nile"]) == 1.0
    assert f1_score(".", ["Nile"]) == 0.0
    assert f1_score("Amazon", ["Nile"]) == 0.0


def test_first_action_takes_the_tag_that_closes_first() -> None:
    assert first_action("think <search>who</search> then <answer>x</answer>") == ("search", "who")
    assert first_action("<answer>x</answer> <search>who</search>") == ("answer", "x")
    assert first_action("<SEARCH> a b </Search>") == ("search", "a b")
    assert first_action("<search>unclosed <answer>y</answer>") == ("answer", "y")
    assert first_action("<search><search>inner</search>") == ("search", "inner")
    assert first_action("no tags at all") is None
    assert first_action("İİ <answer>ok</answer>") == ("answer", "ok")


def test_first_action_is_fast_on_a_megabyte_of_unclosed_tags() -> None:
    reply = "<search><answer>" * (1 << 16)
    start = time.perf_counter()
    assert first_action(reply) is None
    assert first_action(reply + "</answer>") is not None
    assert time.perf_counter() - start < 0.5
