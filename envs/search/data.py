"""Question and corpus files in the layouts Search-R1 and FlashRAG users already have.

Questions: JSON lines or Parquet rows with ``question`` and ``golden_answers`` (a list, or a
single string); ``id`` is optional. Corpus: JSON lines (or Parquet) rows with ``id`` and
``contents``, the title on the first line of ``contents`` and the text after it (FlashRAG's
``wiki-18.jsonl``), or rows with ``title`` and ``text``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Question:
    """One question and the answers that count as correct."""

    question: str
    golden_answers: tuple[str, ...]
    id: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """Yield dict rows of a ``.jsonl``/``.json`` or ``.parquet`` file."""
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        yield from pq.read_table(path).to_pylist()
        return
    if suffix not in (".jsonl", ".json", ".ndjson"):
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .jsonl or .parquet")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); expected one object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield row


def load_questions(path: str | Path) -> list[Question]:
    """Read a question file (``question`` + ``golden_answers`` per row)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"question file {path} does not exist")
    questions = []
    for n, row in enumerate(_rows(path)):
        golds = row.get("golden_answers", row.get("answers", row.get("answer")))
        if "question" not in row or golds is None:
            raise ValueError(
                f"{path}: row {n} has keys {sorted(row)}; each row needs 'question' and "
                "'golden_answers' (the FlashRAG / Search-R1 layout)"
            )
        golds = [golds] if isinstance(golds, str) else [str(g) for g in golds]
        meta = {k: v for k, v in row.items() if k not in ("question", "golden_answers", "id")}
        questions.append(Question(str(row["question"]), tuple(golds), str(row.get("id", n)), meta))
    if not questions:
        raise ValueError(f"question file {path} holds no questions")
    return questions


def split_contents(contents: str) -> tuple[str, str]:
    """Split Search-R1 ``contents`` into (title, text); FlashRAG quotes titles, which are unquoted."""
    title, _, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return title, text.strip()


def load_corpus(path: str | Path) -> list[tuple[str, str, str]]:
    """Read a corpus file into ``(id, title, text)`` triples, in file order."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus file {path} does not exist")
    passages = []
    for n, row in enumerate(_rows(path)):
        if "contents" in row:
            title, text = split_contents(str(row["contents"]))
        elif "text" in row:
            title, text = str(row.get("title", "")), str(row["text"])
        else:
            raise ValueError(f"{path}: row {n} has keys {sorted(row)}; expected 'id' and 'contents' "
                             "(title on the first line) or 'title' and 'text'")
        passages.append((str(row.get("id", n)), title, text))
    if not passages:
        raise ValueError(f"corpus file {path} holds no passages")
    return passages
