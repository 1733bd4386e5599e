"""Web-search question answering (``freshper/SearchQA-v0``) and its retrieval stack.

- :class:`SearchQAEnv` and :func:`batch_search` (env.py): the task, Search-R1 style tags;
- :class:`BM25Retriever`, :class:`HTTPRetriever`, :class:`CachedRetriever` (retriever.py);
- ``python -m envs.search.server``: a Search-R1 compatible retrieval service (server.py);
- :func:`load_questions`, :func:`load_corpus` (data.py): FlashRAG / Search-R1 file layouts;
- :func:`normalize_answer`, :func:`exact_match`, :func:`f1_score` (metrics.py);
- :mod:`envs.search.kb`: the seeded fictional knowledge base used by default.
"""

from envs.search.data import Question, load_corpus, load_questions
from envs.search.env import SearchQAEnv, batch_search, first_action, shared_retriever
from envs.search.metrics import exact_match, f1_score, normalize_answer
from envs.search.retriever import (
    BM25Retriever,
    CachedRetriever,
    HTTPRetriever,
    Passage,
    RetrievalError,
    Retriever,
)

__all__ = [
    "BM25Retriever",
    "CachedRetriever",
    "HTTPRetriever",
    "Passage",
    "Question",
    "RetrievalError",
    "Retriever",
    "SearchQAEnv",
    "batch_search",
    "exact_match",
    "f1_score",
    "first_action",
    "load_corpus",
    "load_questions",
    "normalize_answer",
    "shared_retriever",
]
