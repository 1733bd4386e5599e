"""``freshper/SearchQA-v0``: answer a question by searching a corpus, Search-R1 style.

Each reply may reason freely and must contain one action tag:

- ``<search>query</search>``: the next observation holds the top-k passages, numbered, inside
  ``<information>...</information>`` (each passage cut to ``passage_chars`` characters);
- ``<answer>text</answer>``: the episode ends (``terminated``); the reward is exact match
  (:mod:`envs.search.metrics`; ``em_normalization="search-r1"``, the published metric, by
  default, or ``"unicode"``), ``info["em"]`` and ``info["f1"]`` report both scores.

Parsing rules: tags are case-insensitive; if a reply holds several complete tags, the one that
*closes first* counts (Search-R1 stops generating at ``</search>``, so text after it is
unseen). A reply with neither tag, or an empty query, is invalid (format penalty, no change).
Queries longer than ``max_query_chars`` are cut. A search after ``max_searches`` searches ends
the episode (``terminated``, reward 0, ``info["search_limit"] = True``); ``max_turns`` ends it
with ``truncated``. If retrieval fails (service down after retries), the episode ends with
``truncated=True``, reward 0, ``info["failed"] = True`` and ``info["error"]``, so a runner can
drop it from learning; ``on_retrieval_error="raise"`` raises :class:`RetrievalError` instead.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from envs.base import ClientKwarg, MultiTurnEnv
from envs.search.data import Question, load_questions
from envs.search.metrics import DEFAULT_NORMALIZATION, check_normalization, exact_match, f1_score
from envs.search.retriever import (
    BM25Retriever,
    CachedRetriever,
    HTTPRetriever,
    Passage,
    RetrievalError,
    Retriever,
    check_client_settings,
)

logger = logging.getLogger(__name__)

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_SHARED: dict[str, Retriever] = {}
_SHARED_LOCK = threading.Lock()


def first_action(reply: str) -> tuple[str, str] | None:
    """``(tag, content)`` of the first complete ``<search>`` or ``<answer>`` in ``reply``, else None.

    "First" means the earliest closing tag; the content runs from the nearest opening tag
    before it. Linear time on any input.
    """
    lower = reply.translate(_ASCII_LOWER)
    best: tuple[int, str, str] | None = None
    for tag in ("search", "answer"):
        open_tag, close_tag = f"<{tag}>", f"</{tag}>"
        start = lower.find(open_tag)
        if start < 0:
            continue
        close = lower.find(close_tag, start + len(open_tag))
        if close < 0:
            continue
        start = lower.rfind(open_tag, start, close)
        if best is None or close < best[0]:
            best = (close, tag, reply[start + len(open_tag) : close].strip())
    return None if best is None else (best[1], best[2])


#: Capitalised words that open a passage's sentences rather than name something.
_NOT_NAMES = frozenset({"The", "In", "It", "Its", "He", "She", "His", "Her", "A", "An", "Doc", "Title"})


#: Where :meth:`SearchQAEnv.sample_reply` draws its random answers from (``random_answers``).
RANDOM_ANSWERS = ("seen", "best")


def answer_candidates(text: str) -> list[str]:
    """The short answers a passage text offers, in order, repeats kept: every 4-digit number
    (a year), every run of capitalised words (a name or place, ``"Grebex Moumoutheind"``) and,
    where a run has several words, each of them (``"Megras"`` of ``"Megras, Tryshusk"`` is cut at
    the comma anyway). Sentence openers such as ``The`` or ``In`` are not names."""
    out: list[str] = []
    run: list[str] = []

    def close() -> None:
        if run:
            out.append(" ".join(run))
            if len(run) > 1:
                out.extend(run)
            run.clear()

    for raw in text.split():
        word = raw.strip(".,;:()\"'")
        if len(word) == 4 and word.isdigit():
            close()
            out.append(word)
        elif word[:1].isupper() and word not in _NOT_NAMES:
            run.append(word)
        else:
            close()
        if raw[-1:] in ".,;:)":  # punctuation ends a name
            close()
    close()
    return out


def unasked_candidates(text: str, question: str) -> list[str]:
    """:func:`answer_candidates` of ``text`` that share no word with ``question`` (a question
    never asks for the entity it names)."""
    asked = {w.strip("?.,;:'\"") for w in question.split()}
    return [c for c in answer_candidates(text) if not set(c.split()) & asked]


def shared_retriever(corpus: str | Path | None = None, retrieval_url: str | None = None, *,
                     timeout: float = 10.0, retries: int = 3, backoff: float = 0.5) -> Retriever:
    """One cached retriever per corpus or URL per process, shared by every env that uses it.

    Sharing means 64 envs build one BM25 index, and :func:`batch_search` can send their
    queries in one call.
    """
    if not retrieval_url and corpus is None:  # the default corpus of the current cache root
        from envs.search.kb import default_paths

        corpus = default_paths()["corpus"]
    key = ((f"url {retrieval_url} {timeout} {retries} {backoff}") if retrieval_url
           else f"corpus {Path(corpus).resolve()}")  # type: ignore[arg-type]
    with _SHARED_LOCK:
        if key not in _SHARED:
            if retrieval_url:
                inner: Retriever = HTTPRetriever(retrieval_url, timeout=timeout, retries=retries, backoff=backoff)
            else:
                inner = BM25Retriever(corpus)  # type: ignore[arg-type]
            _SHARED[key] = CachedRetriever(inner)
        return _SHARED[key]


class SearchQAEnv(MultiTurnEnv):
    """Question answering with a search tool (see the module docstring for the exact rules)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}
    modality = "text"
    #: A served search task's clients may shape an episode, never name files or a retrieval url.
    client_kwargs: ClassVar = {"max_turns": ClientKwarg(int, 1, 20), "max_searches": ClientKwarg(int, 0, 10),
                               "topk": ClientKwarg(int, 1, 10), "format_penalty": ClientKwarg(float, -1.0, 0.0),
                               "split": ClientKwarg(str, choices=("train", "test"))}

    def __init__(
        self,
        *,
        questions: str | Path | Sequence[Question] | None = None,
        corpus: str | Path | None = None,
        retrieval_url: str | None = None,
        retriever: Retriever | None = None,
        split: str = "train",
        topk: int = 3,
        max_turns: int = 6,
        max_searches: int = 4,
        passage_chars: int = 400,
        max_query_chars: int = 512,
        on_retrieval_error: str = "fail",
        retrieval_timeout: float = 10.0,
        retrieval_retries: int = 3,
        em_normalization: str = DEFAULT_NORMALIZATION,
        max_title_chars: int = 200,
        format_penalty: float = -0.1,
        random_answers: str = "seen",
        render_mode: str | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, format_penalty=format_penalty, render_mode=render_mode)
        if random_answers not in RANDOM_ANSWERS:
            raise ValueError(f"random_answers must be one of {RANDOM_ANSWERS}, got {random_answers!r}")
        self.random_answer_source = random_answers
        if on_retrieval_error not in ("fail", "raise"):
            raise ValueError(f"on_retrieval_error must be 'fail' or 'raise', got {on_retrieval_error!r}")
        if topk < 1 or max_searches < 0 or passage_chars < 1 or max_query_chars < 1 or max_title_chars < 1:
            raise ValueError("topk, passage_chars, max_query_chars and max_title_chars must be >= 1 and "
                             "max_searches >= 0")
        check_client_settings(retrieval_timeout, retrieval_retries, 0.5)
        self.em_normalization = check_normalization(em_normalization)
        self.max_title_chars = int(max_title_chars)
        if questions is None:
            if split not in ("train", "test"):
                raise ValueError(f"split must be 'train' or 'test' for the default questions, got {split!r}")
            from envs.search.kb import default_paths

            questions = default_paths()[split]
        self.questions = list(questions) if not isinstance(questions, (str, Path)) else load_questions(questions)
        if not self.questions:
            raise ValueError("no questions given")
        self.retriever = retriever or shared_retriever(corpus, retrieval_url, timeout=retrieval_timeout,
                                                       retries=retrieval_retries)
        self.topk, self.max_searches = int(topk), int(max_searches)
        self.passage_chars, self.max_query_chars = int(passage_chars), int(max_query_chars)
        self.on_retrieval_error = on_retrieval_error
        self.question = self.questions[0]
        self._prefetched: tuple[str, int, list[Passage] | RetrievalError] | None = None
        self._clear_episode()
        self._build_spaces()

    def _clear_episode(self) -> None:
        self.searches = 0
        self.answer: str | None = None
        self.em = self.f1 = 0.0
        self.failed, self.error, self.search_limit = False, "", False
        self.transcript: list[str] = []
        self._last_titles: list[str] = []
        self._seen_text: list[str] = []  # the passages shown so far
        self._top_text = ""  # the best passage of the last search (random answers draw from it first)

    # -- MultiTurnEnv hooks ----------------------------------------------------------------
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        index = (options or {}).get("index")
        if index is None:
            index = int(self.np_random.integers(len(self.questions)))
        self.question = self.questions[int(index) % len(self.questions)]
        self._prefetched = None
        self._clear_episode()

    def instructions(self) -> str:
        return (
            "Answer the question. You can search a knowledge base: write <search>your query</search> "
            f"and the top {self.topk} passages come back between <information> and </information>. "
            f"You may search up to {self.max_searches} times. When you know the answer, write "
            "<answer>the answer</answer> with only the short answer (a name, place or year). "
            "You may reason before the tag; only the first <search> or <answer> in a reply counts, "
            "e.g. <search>Acme Works founder</search> or <answer>Paris</answer>."
        )

    def state_text(self) -> str:
        return f"Question: {self.question.question}\nSearches left: {self.max_searches - self.searches}."

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        action = first_action(reply)
        if action is None:
            return None, "no <search>query</search> or <answer>answer</answer> found; reply with one of them."
        tag, content = action
        if tag == "search":
            if not content:
                return None, "the search query is empty; write <search>your query</search>."
            return ("search", content[: self.max_query_chars]), None
        return action, None

    def apply_action(self, action: tuple[str, str]) -> tuple[float, str, bool, bool]:
        tag, content = action
        if tag == "answer":
            golds = self.question.golden_answers
            norm = self.em_normalization
            self.answer, self.em, self.f1 = content, exact_match(content, golds, norm), f1_score(content, golds, norm)
            self.transcript.append(f"answer: {content} -> {'correct' if self.em else 'wrong'}")
            verdict = "correct" if self.em else "not correct"
            return self.em, f"Your answer {content!r} is {verdict}.", True, bool(self.em)
        if self.searches >= self.max_searches:
            self.search_limit = True
            self.transcript.append(f"search: {content} -> refused (no searches left)")
            return 0.0, f"Search limit reached ({self.max_searches} searches) without an answer.", True, False
        try:
            passages = self._retrieve(content)
        except RetrievalError as err:
            if self.on_retrieval_error == "raise":
                raise
            logger.warning("retrieval failed; episode marked failed: %s", err)
            self.failed, self.error = True, str(err)
            self.transcript.append(f"search: {content} -> retrieval failed")
            return 0.0, "The search service is unavailable; the episode is aborted.", True, False
        self.searches += 1
        passages = passages[: self.topk]
        titles = [p.title[: self.max_title_chars] for p in passages]
        self.transcript.append(f"search: {content} -> " + ", ".join(titles))
        block = self.format_passages(passages)
        self._last_titles = titles
        self._seen_text.extend(p.text[: self.passage_chars] for p in passages)
        self._top_text = passages[0].text[: self.passage_chars] if passages else ""
        return 0.0, block, False, False

    # -- the rest of the task contract ------------------------------------------------------
    def sample_reply(self, rng: np.random.Generator) -> str:
        """A random well-formed reply: a search for the question (whole, or a span of 2-5 of
        its words), or, once passages were seen, an answer drawn uniformly from
        :meth:`random_answers` (names, places and years: what the instructions say an answer
        is). Nothing says which one is right."""
        candidates = self.random_answers()
        if candidates and rng.random() < 0.5:
            return f"<answer>{candidates[int(rng.integers(len(candidates)))]}</answer>"
        words = self.question.question.rstrip("?").split()
        if rng.random() < 0.5 or len(words) <= 2:
            return f"<search>{' '.join(words)}</search>"
        n = int(rng.integers(2, min(5, len(words)) + 1))
        start = int(rng.integers(len(words) - n + 1))
        return f"<search>{' '.join(words[start:start + n])}</search>"

    def random_answers(self) -> list[str]:
        """The answers :meth:`sample_reply` draws from (repeats kept; empty before any passage
        was seen). ``random_answers="seen"`` (the default): the :func:`answer_candidates` of
        every passage seen. ``"best"``: those of the last search's best passage that share no
        word with the question, else (a search that found nothing, or only the question's own
        names) those of every passage seen, likewise: a lower-entropy draw that prefers what the
        search found first."""
        if self.random_answer_source == "seen":
            return answer_candidates(" ".join(self._seen_text))
        question = self.question.question
        return unasked_candidates(self._top_text, question) or unasked_candidates(" ".join(self._seen_text), question)

    def tokenizer_text(self) -> str:
        """The passages of an in-process corpus (title line, then text), so the embedded tiny
        model's tokenizer has tokens for the knowledge base's names; a remote retrieval
        service's corpus is not at hand: empty."""
        passages = getattr(self.retriever, "passages", None) or []
        return "\n".join(f"{p.title}\n{p.text}" for p in passages)

    def describe_action(self, reply: str) -> str:
        action = first_action(reply if isinstance(reply, str) else "")
        return reply.strip() if action is None else f"{action[0]} {action[1]}"

    def outcome_text(self, terminated: bool, success: bool) -> str:
        """What the last action led to: ``correct`` / ``not correct`` for an answer, else the
        titles of the passages a search returned (the dynamics pretraining target)."""
        if terminated:
            return "correct" if success else "not correct"
        return "Titles: " + " | ".join(self._last_titles) if self._last_titles else "no passages"

    def task_info(self) -> dict[str, Any]:
        return {"question": self.question.question, "golden_answers": list(self.question.golden_answers),
                "searches": self.searches, "em": self.em, "f1": self.f1, "failed": self.failed,
                "error": self.error, "search_limit": self.search_limit}

    def render_text(self) -> str:
        lines = [f"Question: {self.question.question}", *self.transcript]
        if self.answer is not None:
            lines.append(f"gold: {' | '.join(self.question.golden_answers)}")
        return "\n".join(lines)

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        self._prefetched = None
        if self.failed:  # not a real end of the task: report it as cut short
            terminated, truncated = False, True
        return obs, reward, terminated, truncated, info

    # -- retrieval ---------------------------------------------------------------------------
    def format_passages(self, passages: list[Passage]) -> str:
        """The ``<information>`` block: the first ``topk`` passages numbered, title (cut to
        ``max_title_chars``) then text cut to ``passage_chars``, whatever the retriever sent."""
        if not passages:
            return "<information>\nNo passages found.\n</information>"
        lines = []
        for n, p in enumerate(passages[: self.topk], 1):
            text = p.text if len(p.text) <= self.passage_chars else p.text[: self.passage_chars].rstrip() + "..."
            title = p.title if len(p.title) <= self.max_title_chars else p.title[: self.max_title_chars].rstrip() + "..."
            lines.append(f"Doc {n} (Title: {title}) {text}")
        return "<information>\n" + "\n".join(lines) + "\n</information>"

    @classmethod
    def before_batch_step(cls, envs: Sequence["MultiTurnEnv"], replies: Sequence[str]) -> None:
        """One retrieval request for every search of the turn (:func:`batch_search`)."""
        batch_search(envs, replies)

    def pending_query(self, reply: str) -> str | None:
        """The query ``step(reply)`` would send to the retriever, or None if it would not search."""
        if self._done or self.searches >= self.max_searches:
            return None
        parsed, error = self.parse_action(reply if isinstance(reply, str) else "")
        if error is not None or parsed[0] != "search":
            return None
        return parsed[1][: self.max_query_chars]

    def prefetch(self, query: str, result: list[Passage] | RetrievalError) -> None:
        """Hand in the retrieval result for ``query``, used by the next ``step`` that searches it."""
        self._prefetched = (query, self.topk, result)

    def _retrieve(self, query: str) -> list[Passage]:
        query = query[: self.max_query_chars]
        if self._prefetched is not None and self._prefetched[:2] == (query, self.topk):
            result = self._prefetched[2]
            self._prefetched = None
            if isinstance(result, RetrievalError):
                raise result
            return result
        return self.retriever.search([query], self.topk)[0]


def batch_search(envs: Sequence[Any], replies: Sequence[str]) -> int:
    """Retrieve for every env whose reply is a search, one ``retriever.search`` call per retriever.

    Call it before stepping each env with its reply; the results wait in the envs and ``step``
    uses them instead of searching alone. Envs of other tasks (or wrapped ones without a
    ``SearchQAEnv`` inside) are skipped, so a runner may call it for any batch. Returns the
    number of queries sent.
    """
    groups: dict[tuple[int, int], tuple[Retriever, list[tuple[SearchQAEnv, str]]]] = {}
    for env, reply in zip(envs, replies, strict=True):
        inner = getattr(env, "unwrapped", env)
        if not isinstance(inner, SearchQAEnv):
            continue
        query = inner.pending_query(reply)
        if query is not None:
            groups.setdefault((id(inner.retriever), inner.topk), (inner.retriever, []))[1].append((inner, query))
    sent = 0
    for (_, topk), (retriever, items) in groups.items():
        unique = list(dict.fromkeys(q for _, q in items))
        try:
            hits: dict[str, list[Passage] | RetrievalError] = dict(zip(unique, retriever.search(unique, topk)))
        except RetrievalError as err:
            hits = {q: err for q in unique}
        sent += len(unique)
        for env, query in items:
            env.prefetch(query, hits[query])
    return sent

