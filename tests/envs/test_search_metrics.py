"""Answer scoring and reply parsing for the search task: no substring credit, linear parsing."""

from __future__ import annotations

import re
import string
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
        ("«Zürich»", "«zürich»"),  # the published (ASCII) normalisation keeps typographic quotes
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


# Search-R1's evaluation normalisation (its reward function's normalize_answer), written out so
# the default is checked against the published metric itself.
def _search_r1_normalize(s: str) -> str:
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def _search_r1_em(prediction: str, golden_answers: list[str]) -> float:
    normalized_prediction = _search_r1_normalize(prediction)
    return float(any(_search_r1_normalize(g) == normalized_prediction for g in golden_answers))


CASES = ["\u201cParis\u201d", "Paris", "The Eiffel Tower!", "«Zürich»", "U.S.A.", "it\u2019s", "Ça va—oui",
         "  a   Quick\tbrown  fox. ", "Jean-Paul Sartre", "¿Qué?", "New York City (NYC)", "1,000,000", "$5"]


@pytest.mark.parametrize("text", CASES)
def test_default_normalisation_is_search_r1s_published_one(text: str) -> None:
    assert normalize_answer(text) == _search_r1_normalize(text)
    assert exact_match(text, ["Paris", "Zurich", "its", "usa"]) == _search_r1_em(text, ["Paris", "Zurich", "its", "usa"])


def test_the_unicode_normalisation_is_the_lenient_option() -> None:
    assert exact_match("\u201cParis\u201d", ["Paris"]) == 0.0  # as published
    assert exact_match("\u201cParis\u201d", ["Paris"], normalization="unicode") == 1.0
    assert normalize_answer("«Zürich»", "unicode") == "zürich"
    assert f1_score("\u201cParis\u201d France", ["Paris"], normalization="unicode") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="normalization must be one of"):
        normalize_answer("x", "ascii")
