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
        if (path / "params.index.json").exists():
            self._bm25 = bm25s.BM25.load(str(path), show_progress=False)
            logger.debug("loaded BM25 index %s", path)
        else:
            start = time.perf_counter()
            self._bm25 = bm25s.BM25(k1=k1, b=b)
            self._bm25.index([tokenize(p.contents) for p in self.passages], show_progress=False)
            self._save(path)
            logger.info("built BM25 index of %d passages in %.1fs (cached in %s)",
                        len(self.passages), time.perf_counter() - start, path)
        self._vocab: dict[str, int] = self._bm25.vocab_dict

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
    """

    def __init__(self, url: str, *, timeout: float = 10.0, retries: int = 3, backoff: float = 0.5,
                 client: Any = None) -> None:
        import httpx

        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.retries = int(retries)
        self.backoff = float(backoff)
        self._client = client or httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._client.close()

    def search(self, queries: list[str], topk: int) -> list[list[Passage]]:
        import httpx

        if not queries:
            return []
        payload = {"queries": list(queries), "topk": int(topk), "return_scores": True}
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self._client.post(self.url, json=payload)
            except httpx.HTTPError as err:  # connect/read errors and timeouts
                last = f"{type(err).__name__}: {err}"
                logger.warning("retrieval attempt %d/%d to %s failed: %s", attempt + 1, self.retries + 1, self.url, last)
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                logger.warning("retrieval attempt %d/%d to %s failed: %s", attempt + 1, self.retries + 1, self.url, last)
                continue
            if response.status_code != 200:
                raise RetrievalError(f"retrieval service {self.url} rejected the request: "
                                     f"HTTP {response.status_code}: {response.text[:500]}")
            return self._parse(response, len(queries))
        raise RetrievalError(f"retrieval service {self.url} failed after {self.retries + 1} attempts; last error: {last}")

    def _parse(self, response: Any, n: int) -> list[list[Passage]]:
        try:
            result = response.json()["result"]
            if not isinstance(result, list) or len(result) != n:
                raise ValueError(f"expected {n} result lists")
            return [[Passage.from_document(item["document"], item.get("score", 0.0))
                     if "document" in item else Passage.from_document(item)
                     for item in hits] for hits in result]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise RetrievalError(f"retrieval service {self.url} sent a malformed answer ({err}): "
                                 f"{response.text[:300]}") from None


class CachedRetriever:
    """A thread-safe LRU cache of ``(query, topk) -> passages`` in front of another retriever.

    Rollouts of one question (a GRPO group) often issue the same query; each is fetched once.
    """

    def __init__(self, inner: Retriever, maxsize: int = 4096) -> None:
        self.inner = inner
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
