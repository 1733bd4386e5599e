"""Answer scoring for question answering: normalisation, exact match and token F1.

Exact match is *equality* after normalisation (SQuAD style: lowercase, drop punctuation,
drop the articles a/an/the, collapse whitespace) against any gold answer. Unlike the
reference implementation there is no substring credit, and an answer that normalises to
the empty string (``"."``, ``"the"``, ``""``) scores 0.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _is_punctuation(char: str) -> bool:
    return unicodedata.category(char).startswith("P") or char in "$+<=>^`|~"


def normalize_answer(text: str) -> str:
    """Lowercase, remove punctuation (ASCII and Unicode), articles and extra whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if not _is_punctuation(ch))  # deleted, as in SQuAD
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golden: str | Iterable[str]) -> list[str]:
    return [golden] if isinstance(golden, str) else [str(g) for g in golden]


def exact_match(prediction: str, golden: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals some normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    if not pred:
        return 0.0
    return float(any(pred == normalize_answer(g) for g in _golds(golden)))


def f1_score(prediction: str, golden: str | Iterable[str]) -> float:
    """Best token-level F1 between the normalised prediction and any gold answer."""
    pred_tokens = normalize_answer(prediction).split()
    if not pred_tokens:
        return 0.0
    best = 0.0
    for gold in _golds(golden):
        gold_tokens = normalize_answer(gold).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best
