"""Retrievers: the batched ``search`` interface, in-process BM25, and the Search-R1 HTTP client.

Every retriever answers ``search(queries, topk) -> list[list[Passage]]`` for a *batch* of
queries, so a runner can send the queries of all active episodes in one call.
``BM25Retriever`` runs ``bm25s`` in the process (index cached on disk, keyed by the corpus
hash); ``HTTPRetriever`` speaks the Search-R1 protocol to any compatible service, including
``python -m envs.search.server``. Both return the same passages for the same corpus.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from envs.search.data import load_corpus, split_contents

logger = logging.getLogger(__name__)

#: Bump when tokenisation or index layout changes, so old cached indices are not reused.
INDEX_VERSION = 1
_TOKEN = re.compile(r"\w+")


class RetrievalError(RuntimeError):
    """The retrieval service could not answer (after retries) or answered nonsense."""


@dataclass(frozen=True)
class Passage:
    """One retrieved passage. ``contents`` is the Search-R1 form: title, newline, text."""

    id: str
    title: str
    text: str
    score: float = 0.0

    @property
    def contents(self) -> str:
        return f"{self.title}\n{self.text}"

    @classmethod
    def from_document(cls, doc: dict[str, Any], score: float = 0.0) -> Passage:
        """Build from a Search-R1 document (``id``, ``contents``) or a ``title``/``text`` one."""
        if "contents" in doc:
            title, text = split_contents(str(doc["contents"]))
        else:
            title, text = str(doc.get("title", "")), str(doc.get("text", ""))
        return cls(str(doc.get("id", "")), title, text, float(score))


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with the top-k passages of each."""

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]: ...


@functools.lru_cache(maxsize=1)
def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens without English stopwords (the same for corpus and queries)."""
    stop = _stopwords()
    return [t for t in _TOKEN.findall(text.lower()) if t not in stop]


def cache_dir_default() -> Path:
    from envs.search.kb import cache_root

    return cache_root() / "search" / "index"


class BM25Retriever:
    """In-process BM25 (``bm25s``) over a corpus file or a list of passages.

    The index is saved under ``cache_dir/<sha256 of corpus + parameters>`` and reloaded on the
    next start, so a large corpus is tokenised once. Ties in score go to the earlier passage,
    and passages that share no term with the query are not returned, so results are exact
    and identical in every process.
    """

    def __init__(
        self,
        corpus: str | Path | Sequence[Passage],
        *,
        cache_dir: str | Path | None = None,
        k1: float = 1.5,
        b: float = 0.75,
    ) -> None:
        import bm25s

        if logging.getLogger("bm25s").level == logging.DEBUG:  # bm25s sets DEBUG on import: its lines as the app's
            logging.getLogger("bm25s").setLevel(logging.NOTSET)
        if isinstance(corpus, (str, Path)):
            self.passages = [Passage(i, t, x) for i, t, x in load_corpus(corpus)]
        else:
            self.passages = list(corpus)
        if not self.passages:
            raise ValueError("BM25Retriever needs at least one passage")
        digest = hashlib.sha256(f"v{INDEX_VERSION} k1={k1} b={b}\n".encode())
        for p in self.passages:
            digest.update(json.dumps([p.id, p.title, p.text]).encode() + b"\n")
        self.key = digest.hexdigest()[:24]
        root = Path(cache_dir) if cache_dir is not None else cache_dir_default()
        path = root / self.key
        self._bm25 = self._load(path) if (path / "params.index.json").exists() else None
        if self._bm25 is None:
            start = time.perf_counter()
            self._bm25 = bm25s.BM25(k1=k1, b=b)
            self._bm25.index([tokenize(p.contents) for p in self.passages], show_progress=False)
            self._save(path)
            logger.info("built BM25 index of %d passages in %.1fs (cached in %s)",
                        len(self.passages), time.perf_counter() - start, path)
        self._vocab: dict[str, int] = self._bm25.vocab_dict

    def _load(self, path: Path) -> Any:
        """The cached index, or None when it cannot be used (then it is rebuilt and replaced).

        A cache can be damaged (a disk filled up, a file truncated by hand, a copy cut short);
        a damaged one must not make the corpus unusable, so any failure to load it, or an index
        whose document count or vocabulary does not fit the corpus, means: rebuild.
        """
        import bm25s

        try:
            index = bm25s.BM25.load(str(path), show_progress=False)
            num_docs = int(index.scores["num_docs"])
            vocab = index.vocab_dict
            # one pointer per term plus one; bm25s counts the empty token in the vocabulary or not
            pointers = len(index.scores["indptr"])
            if num_docs != len(self.passages) or not isinstance(vocab, dict) or not len(vocab) <= pointers <= len(vocab) + 1:
                raise ValueError(f"it holds {num_docs} documents and {len(vocab)} terms for a corpus of "
                                 f"{len(self.passages)} passages")
            logger.debug("loaded BM25 index %s", path)
            return index
        except Exception as err:  # any damage: rebuild rather than fail
            logger.warning("the cached BM25 index in %s is damaged (%s: %s); rebuilding it",
                           path, type(err).__name__, str(err)[:200])
            shutil.rmtree(path, ignore_errors=True)
            return None

    def _save(self, path: Path) -> None:
        """Write the index atomically; a concurrent writer of the same key simply wins."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-")
            self._bm25.save(tmp, show_progress=False)
            try:
                os.replace(tmp, path)
            except OSError:  # another process saved the same index first
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as err:
            logger.warning("could not cache the BM25 index in %s: %s", path, err)

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        return [self._search_one(q, topk) for q in queries]

    def _search_one(self, query: str, topk: int) -> list[Passage]:
        ids = [self._vocab[t] for t in tokenize(query) if t in self._vocab]
        if not ids:
            return []
        scores = self._bm25.get_scores_from_ids(ids)
        k = min(topk, len(scores))
        threshold = np.partition(scores, len(scores) - k)[len(scores) - k]
        cand = np.flatnonzero((scores >= threshold) & (scores > 0))
        order = cand[np.lexsort((cand, -scores[cand]))][:k]
        return [Passage(p.id, p.title, p.text, float(scores[i]))
                for i in order.tolist() for p in (self.passages[i],)]


class HTTPRetriever:
    """Client of a Search-R1 retrieval service (``POST /retrieve``).

    Request ``{"queries": [...], "topk": k, "return_scores": true}``; response
    ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``. Connection
    errors, timeouts, 429 and 5xx are retried ``retries`` times with exponential backoff;
    then, or at once on another 4xx or a malformed answer, :class:`RetrievalError` is raised.

    Limits, so that no answer can stall or flood a trainer (docs/reliability.md):

    - ``timeout`` is a *deadline* for each attempt, from sending to the last byte of the answer
      (not a per-read timeout, which a server trickling a byte every few seconds never trips):
      an attempt past it is abandoned and counts as a timeout. One ``search`` call therefore
      takes at most ``(retries + 1) * timeout`` plus the backoff pauses.
    - an answer larger than ``max_response_bytes`` is refused (malformed, not retried);
    - each query keeps its first ``topk`` passages; titles are cut to ``max_title_chars`` and
      texts to ``max_text_chars``;
    - JSON nested too deeply to parse is a malformed answer, like any other.
    """

    def __init__(self, url: str, *, timeout: float = 10.0, retries: int = 3, backoff: float = 0.5,
                 client: Any = None, max_response_bytes: int = 16 << 20, max_title_chars: int = 256,
                 max_text_chars: int = 10_000) -> None:
        import httpx

        check_client_settings(timeout, retries, backoff)
        if min(max_response_bytes, max_title_chars, max_text_chars) < 1:
            raise ValueError("max_response_bytes, max_title_chars and max_text_chars must be >= 1")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_response_bytes = int(max_response_bytes)
        self.max_title_chars, self.max_text_chars = int(max_title_chars), int(max_text_chars)
        self._client = client or httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        if not queries:
            return []
        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            outcome = self._attempt(payload)
            if isinstance(outcome, RetrievalError):
                raise outcome
            if isinstance(outcome, _Retry):
                last = outcome.reason
                logger.warning("retrieval attempt %d/%d to %s failed: %s", attempt + 1, self.retries + 1, self.url, last)
                continue
            status, body = outcome
            if status != 200:
                raise RetrievalError(f"retrieval service {self.url} rejected the request: "
                                     f"HTTP {status}: {_preview(body, 500)}")
            return self._parse(body, len(queries), int(topk))
        raise RetrievalError(f"retrieval service {self.url} failed after {self.retries + 1} attempts; last error: {last}")

    def _attempt(self, payload: dict[str, Any]) -> tuple[int, bytes] | _Retry | RetrievalError:
        """One request under the deadline: ``(status, body)``, or why it should be retried.

        The request runs in a helper thread so that the caller returns at the deadline whatever
        the server does; the helper stops reading at its next chunk (or its read timeout) and
        closes the connection.
        """
        box: dict[str, Any] = {}
        cancelled = threading.Event()
        worker = threading.Thread(target=self._request, args=(payload, box, cancelled), daemon=True,
                                  name="freshper-retrieval")
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            cancelled.set()
            return _Retry(f"no complete answer within the {self.timeout:g} s deadline")
        if "error" in box:
            return box["error"]
        return box["status"], box["body"]

    def _request(self, payload: dict[str, Any], box: dict[str, Any], cancelled: threading.Event) -> None:
        import httpx

        try:
            with self._client.stream("POST", self.url, json=payload) as response:
                status = response.status_code
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > self.max_response_bytes:
                    box["error"] = RetrievalError(
                        f"retrieval service {self.url} announced an answer of {int(length)} bytes, more than "
                        f"max_response_bytes={self.max_response_bytes}; answer refused")
                    return
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    if cancelled.is_set():
                        return
                    size += len(chunk)
                    if size > self.max_response_bytes:
                        box["error"] = RetrievalError(
                            f"retrieval service {self.url} sent more than max_response_bytes="
                            f"{self.max_response_bytes} bytes; answer refused")
                        return
                    chunks.append(chunk)
            body = b"".join(chunks)
            if status == 429 or status >= 500:
                box["error"] = _Retry(f"HTTP {status}: {_preview(body, 200)}")
            else:
                box["status"], box["body"] = status, body
        except httpx.HTTPError as err:  # connect/read errors and timeouts
            box["error"] = _Retry(f"{type(err).__name__}: {err}")
        except Exception as err:  # never let the helper thread die silently
            box["error"] = _Retry(f"{type(err).__name__}: {err}")

    def _parse(self, body: bytes, n: int, topk: int) -> list[list[Passage]]:
        try:
            result = json.loads(body.decode("utf-8"))["result"]
            if not isinstance(result, list) or len(result) != n:
                raise ValueError(f"expected {n} result lists")
            out = []
            for hits in result:
                if not isinstance(hits, list):
                    raise ValueError("each result must be a list of documents")
                passages = []
                for item in hits[:topk]:  # a service may send more than asked: keep the top k
                    if not isinstance(item, dict):
                        raise ValueError(f"a document must be an object, got {type(item).__name__}")
                    doc = item["document"] if "document" in item else item
                    if not isinstance(doc, dict):
                        raise ValueError(f"a document must be an object, got {type(doc).__name__}")
                    p = Passage.from_document(doc, item.get("score", 0.0) if "document" in item else 0.0)
                    passages.append(Passage(p.id[:self.max_title_chars], p.title[:self.max_title_chars],
                                            p.text[:self.max_text_chars], p.score))
                out.append(passages)
            return out
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, UnicodeDecodeError) as err:
            raise RetrievalError(f"retrieval service {self.url} sent a malformed answer "
                                 f"({type(err).__name__}: {str(err)[:200]}): {_preview(body, 300)}") from None


@dataclass(frozen=True)
class _Retry:
    """An attempt that failed in a way worth retrying (connection, timeout, 429, 5xx)."""

    reason: str


def _preview(body: bytes, n: int) -> str:
    return body[:n].decode("utf-8", errors="replace")


def check_client_settings(timeout: float, retries: int, backoff: float) -> None:
    """Reject retrieval client settings that would make no attempt or fail every one."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"retrieval timeout must be a positive number of seconds, got {timeout!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retrieval retries must be an integer >= 0 (0: one attempt), got {retries!r}")
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not (backoff >= 0 and math.isfinite(backoff)):
        raise ValueError(f"retrieval backoff must be a number of seconds >= 0, got {backoff!r}")


class CachedRetriever:
    """A thread-safe LRU cache of ``(query, topk) -> passages`` in front of another retriever.

    Rollouts of one question (a GRPO group) often issue the same query; each is fetched once.
    """

    def __init__(self, inner: Retriever, maxsize: int = 4096) -> None:
        self.inner = inner
        self.passages = getattr(inner, "passages", None)  # an in-process corpus, where the inner one has it
        self.maxsize = int(maxsize)
        self._cache: OrderedDict[tuple[str, int], list[Passage]] = OrderedDict()
        self._lock = threading.Lock()

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        with self._lock:
            missing = list(dict.fromkeys(q for q in queries if (q, topk) not in self._cache))
        if missing:
            fetched = self.inner.search(missing, topk)
            with self._lock:
                for q, hits in zip(missing, fetched):
                    self._cache[(q, topk)] = hits
                while len(self._cache) > self.maxsize:
                    self._cache.popitem(last=False)
        out = []
        with self._lock:
            for q in queries:
                hits = self._cache.get((q, topk))
                if hits is None:  # evicted between the two locks (tiny cache): fetch again
                    hits = self.inner.search([q], topk)[0]
                else:
                    self._cache.move_to_end((q, topk))
                out.append(hits)
        return out
