"""Answer scoring for question answering: normalisation, exact match and token F1.

Exact match is *equality* after normalisation (SQuAD style: lowercase, drop punctuation,
drop the articles a/an/the, collapse whitespace) against any gold answer. Unlike the
reference implementation there is no substring credit, and an answer that normalises to
the empty string (``"."``, ``"the"``, ``""``) scores 0.

Two normalisations (``normalization=``):

- ``"search-r1"`` (the default): punctuation is ASCII ``string.punctuation`` only, as in the
  Search-R1 / SQuAD evaluation scripts, so scores compare with published tables; ``“Paris”``
  (typographic quotes) does not match ``Paris``.
- ``"unicode"``: every Unicode punctuation character (category P) is removed as well, a more
  lenient score (``“Paris”`` matches ``Paris``).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ASCII_PUNCTUATION = frozenset(string.punctuation)
NORMALIZATIONS = ("search-r1", "unicode")
DEFAULT_NORMALIZATION = "search-r1"


def _is_punctuation(char: str) -> bool:
    return char in _ASCII_PUNCTUATION or unicodedata.category(char).startswith("P")


def check_normalization(normalization: str) -> str:
    """Return ``normalization`` if it is one of :data:`NORMALIZATIONS`, else raise ValueError."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {list(NORMALIZATIONS)}, got {normalization!r}")
    return normalization


def normalize_answer(text: str, normalization: str = DEFAULT_NORMALIZATION) -> str:
    """Lowercase, remove punctuation (ASCII, or also Unicode), articles and extra whitespace."""
    check_normalization(normalization)
    text = text.lower()
    if normalization == "unicode":
        text = "".join(ch for ch in text if not _is_punctuation(ch))
    else:
        text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)  # deleted, as in SQuAD
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(golden: str | Iterable[str]) -> list[str]:
    return [golden] if isinstance(golden, str) else [str(g) for g in golden]


def exact_match(prediction: str, golden: str | Iterable[str], normalization: str = DEFAULT_NORMALIZATION) -> float:
    """1.0 if the normalised prediction equals some normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction, normalization)
    if not pred:
        return 0.0
    return float(any(pred == normalize_answer(g, normalization) for g in _golds(golden)))


def f1_score(prediction: str, golden: str | Iterable[str], normalization: str = DEFAULT_NORMALIZATION) -> float:
    """Best token-level F1 between the normalised prediction and any gold answer."""
    pred_tokens = normalize_answer(prediction, normalization).split()
    if not pred_tokens:
        return 0.0
    best = 0.0
    for gold in _golds(golden):
        gold_tokens = normalize_answer(gold, normalization).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best
