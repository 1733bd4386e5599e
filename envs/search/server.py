"""A Search-R1 compatible retrieval server over the in-process BM25 index, on uvicorn.

    python -m envs.search.server --corpus wiki.jsonl --port 8000   # your corpus
    python -m envs.search.server --port 8000                       # the embedded default corpus

Endpoints: ``POST /retrieve`` with ``{"queries": [str, ...], "topk": int, "return_scores": bool}``
answers ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (plain documents
when ``return_scores`` is false, as Search-R1's server does); ``GET /health`` answers
``{"status": "ok", "passages": N}``. As Search-R1's own server does, an empty ``queries`` list
answers ``{"result": []}`` (its trainer sends one on turns where no rollout searches) and a
missing, null or 0 ``topk`` means the server's default. Bad requests get a 4xx and
``{"error": "..."}``: 411 no length, 413 body too large, 400 malformed JSON (nesting too deep
included) or wrong types, 408 a request not in within ``request_timeout`` of its first byte,
404 unknown path; connections are bounded as :mod:`envs.asgi` says (the lifecycle it shares
with ``python -m envs.serve``). SIGTERM and SIGINT stop it cleanly: it stops accepting
connections, closes its socket and exits with 0.
``--latency-ms`` makes every ``/retrieve`` wait that long first: a remote or loaded retrieval
service, simulated on loopback (``benchmarks/scale_bench.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envs.asgi import HTTPServer, Refused, parse_json, read_body, send_json, serve_until_signal
from envs.asgi import Limits as HTTPLimits
from envs.search.retriever import BM25Retriever, Retriever

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Request limits; anything beyond them is refused with a 4xx."""

    max_body_bytes: int = 1 << 20
    max_queries: int = 1024
    max_query_chars: int = 4096
    max_topk: int = 100
    default_topk: int = 3
    #: A too-large body up to this size is read and discarded so the client sees the 413.
    max_drain_bytes: int = 16 << 20
    #: Seconds a request may take to arrive, first byte to last (a 408 past them, and the
    #: connection closed), and a connection may stay idle.
    request_timeout: float = 30.0
    #: Open connections at most (the longest-idle one closed for a new one; a 503 when all are busy).
    max_connections: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.max_topk:
            raise ValueError(f"max_topk must be >= 1, got {self.max_topk}")
        if not 1 <= self.default_topk <= self.max_topk:
            raise ValueError(f"the default topk must be from 1 to {self.max_topk} (max_topk), got {self.default_topk}")
        if min(self.max_body_bytes, self.max_queries, self.max_query_chars) < 1:
            raise ValueError("max_body_bytes, max_queries and max_query_chars must be >= 1")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def validate(body: Any, limits: Limits) -> tuple[list[str], int, bool]:
    """Check a decoded ``/retrieve`` body; return ``(queries, topk, return_scores)``."""
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object with 'queries' and 'topk'")
    queries = body.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest(400, "'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise BadRequest(400, f"'queries' must hold at most {limits.max_queries} queries, got {len(queries)}")
    too_long = next((i for i, q in enumerate(queries) if len(q) > limits.max_query_chars), None)
    if too_long is not None:
        raise BadRequest(400, f"query {too_long} is longer than {limits.max_query_chars} characters")
    topk = body.get("topk")
    topk = limits.default_topk if topk is None or (topk == 0 and not isinstance(topk, bool)) else topk
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= limits.max_topk:
        raise BadRequest(400, f"'topk' must be an integer from 1 to {limits.max_topk}, got {topk!r}")
    return_scores = body.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(400, f"'return_scores' must be true or false, got {return_scores!r}")
    return queries, topk, return_scores


class RetrievalApp:
    """The ASGI app: ``POST /retrieve`` and ``GET /health``. A body is read on the event loop
    (the connection's deadline and the size cap hold while it arrives); decoding it and the
    search run in a thread, so the loop keeps answering other connections meanwhile."""

    def __init__(self, server: "RetrievalServer") -> None:
        self.server = server

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        server, path, close = self.server, scope["path"], False
        try:
            if scope["method"] == "GET":
                if path != "/health":
                    raise Refused(404, f"unknown path {path[:200]!r}; use POST /retrieve or GET /health")
                status, payload = 200, {"status": "ok", "passages": len(server.retriever)}  # type: ignore[arg-type]
            else:
                if scope["method"] != "POST" or path != "/retrieve":
                    raise Refused(404, f"unknown path {path[:200]!r}; use POST /retrieve", close=True)
                limits = server.limits
                raw = await read_body(scope, receive, limits.max_body_bytes, drain=limits.max_drain_bytes,
                                      what="body")
                if raw is None:  # the client left, or its request did not arrive in time (answered 408)
                    return
                status, payload = await asyncio.to_thread(self._retrieve, raw)
                if status == 200 and server.latency > 0:  # an injected service time (benchmarks, fault tests)
                    await asyncio.sleep(server.latency)
        except Refused as err:
            status, payload, close = err.status, {"error": str(err)}, err.close
        await send_json(send, status, json.dumps(payload, ensure_ascii=False).encode("utf-8"), close=close)

    def _retrieve(self, raw: bytes) -> tuple[int, dict[str, Any]]:
        server = self.server
        try:
            try:
                body = parse_json(raw)
            except ValueError as err:
                raise BadRequest(400, str(err)) from None
            queries, topk, return_scores = validate(body, server.limits)
            server.count_request()
            hits = server.retriever.search(queries, topk) if queries else []
        except BadRequest as err:
            return err.status, {"error": str(err)}
        except Exception as err:  # a bug must not kill the server; the client sees a 500
            logger.exception("retrieval failed")
            return 500, {"error": f"internal error: {type(err).__name__}: {err}"}
        result = [
            [({"document": {"id": p.id, "contents": p.contents}, "score": p.score} if return_scores
              else {"id": p.id, "contents": p.contents}) for p in passages]
            for passages in hits
        ]
        return 200, {"result": result}


class RetrievalServer(HTTPServer):
    """The retrieval service: :class:`RetrievalApp` on the shared uvicorn lifecycle
    (:mod:`envs.asgi`), bound at ``address`` (port 0: a free one) when made."""

    def __init__(self, address: tuple[str, int], retriever: Retriever, limits: Limits | None = None, *,
                 latency: float = 0.0) -> None:
        self.retriever = retriever
        self.limits = limits or Limits()
        #: Seconds each /retrieve request waits before it is answered: a slower service, simulated.
        self.latency = float(latency)
        #: Valid /retrieve requests received so far.
        self.requests = 0
        self._count_lock = threading.Lock()
        super().__init__(RetrievalApp(self), address[0], address[1],
                         limits=HTTPLimits(request_timeout=self.limits.request_timeout,
                                           max_connections=self.limits.max_connections))

    def count_request(self) -> None:
        with self._count_lock:
            self.requests += 1


def serve(corpus: str | Path | None, host: str, port: int, *, topk: int = 3,
          cache_dir: str | Path | None = None, ready_message: bool = True, latency: float = 0.0) -> None:
    """Build (or load) the index, serve until SIGTERM/SIGINT, then shut down cleanly."""
    if corpus is None:
        from envs.search.kb import default_paths

        corpus = default_paths()["corpus"]
    limits = Limits(default_topk=topk)  # checked before the (possibly long) index build
    retriever = BM25Retriever(corpus, cache_dir=cache_dir)
    server = RetrievalServer((host, port), retriever, limits, latency=latency)
    serve_until_signal(server, f"serving {len(retriever)} passages from {corpus} at {server.url}/retrieve"
                       if ready_message else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.search.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", help="JSON lines corpus (id, contents); default: the embedded corpus")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--topk", type=int, default=3, help="top-k when a request gives none")
    parser.add_argument("--cache-dir", help="where BM25 indices are cached")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="wait this long before answering each /retrieve request (simulates a slower service)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    max_topk = Limits.max_topk
    if not 1 <= args.topk <= max_topk:
        parser.error(f"--topk must be from 1 to {max_topk}, got {args.topk}")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(max(logging.WARNING, logging.getLogger().level))
    serve(args.corpus, args.host, args.port, topk=args.topk, cache_dir=args.cache_dir, latency=args.latency_ms / 1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
