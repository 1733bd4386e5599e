"""A Search-R1 compatible retrieval server over the in-process BM25 index (standard library only).

    python -m envs.search.server --corpus wiki.jsonl --port 8000   # your corpus
    python -m envs.search.server --port 8000                       # the embedded default corpus

Endpoints: ``POST /retrieve`` with ``{"queries": [str, ...], "topk": int, "return_scores": bool}``
answers ``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}`` (plain documents
when ``return_scores`` is false, as Search-R1's server does); ``GET /health`` answers
``{"status": "ok", "passages": N}``. As Search-R1's own server does, an empty ``queries`` list
answers ``{"result": []}`` (its trainer sends one on turns where no rollout searches) and a
missing, null or 0 ``topk`` means the server's default. Bad requests get a 4xx and
``{"error": "..."}``: 411 no length, 413 body too large, 400 malformed JSON (nesting too deep
included) or wrong types, 408 a client that stalls mid-body, 404 unknown path. SIGTERM and
SIGINT stop it cleanly: it stops accepting connections, closes its socket and exits with 0.
``--latency-ms`` makes every ``/retrieve`` wait that long first: a remote or loaded retrieval
service, simulated on loopback (``benchmarks/scale_bench.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

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
    #: Seconds a client may stall mid-request before it gets a 408 and its socket is closed.
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_topk:
            raise ValueError(f"max_topk must be >= 1, got {self.max_topk}")
        if not 1 <= self.default_topk <= self.max_topk:
            raise ValueError(f"the default topk must be from 1 to {self.max_topk} (max_topk), got {self.default_topk}")
        if min(self.max_body_bytes, self.max_queries, self.max_query_chars) < 1:
            raise ValueError("max_body_bytes, max_queries and max_query_chars must be >= 1")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")


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


class RetrievalHandler(BaseHTTPRequestHandler):
    """One request; the server object carries the retriever and the limits."""

    server: RetrievalServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else keep-alive replies wait ~40 ms on delayed ACKs
    timeout = 30  # seconds a client may stall mid-request (the server's Limits.request_timeout)

    def setup(self) -> None:
        self.timeout = self.server.limits.request_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        logger.debug("%s - %s", self.address_string(), format % args)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (stdlib name)
        if self.path.split("?")[0] == "/health":
            self._send(200, {"status": "ok", "passages": len(self.server.retriever)})  # type: ignore[arg-type]
        else:
            self._send(404, {"error": f"unknown path {self.path!r}; use POST /retrieve or GET /health"})

    def _read_body(self) -> bytes:
        limits = self.server.limits
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self.close_connection = True
            raise BadRequest(411, "a Content-Length header is required")
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise BadRequest(400, f"invalid Content-Length {length_header!r}") from None
        try:
            if length > limits.max_body_bytes:
                self.close_connection = True
                if length <= limits.max_drain_bytes:  # read it away, so the client gets our 413
                    remaining = length
                    while remaining > 0:
                        chunk = self.rfile.read(min(remaining, 1 << 16))
                        if not chunk:
                            break
                        remaining -= len(chunk)
                raise BadRequest(413, f"body of {length} bytes exceeds the limit of {limits.max_body_bytes}")
            body = self.rfile.read(length)
        except (socket.timeout, TimeoutError):
            self.close_connection = True
            raise BadRequest(408, f"the request body did not arrive within {self.timeout} s") from None
        if len(body) < length:  # the client hung up mid-body
            self.close_connection = True
            raise BadRequest(400, f"the body ended after {len(body)} of {length} bytes")
        return body

    def do_POST(self) -> None:  # noqa: N802 (stdlib name)
        try:
            if self.path.split("?")[0] != "/retrieve":
                self.close_connection = True
                raise BadRequest(404, f"unknown path {self.path!r}; use POST /retrieve")
            raw = self._read_body()
            try:
                body = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise BadRequest(400, f"the body is not valid UTF-8 JSON: {err}") from None
            except RecursionError:
                raise BadRequest(400, "the body's JSON is nested too deeply") from None
            queries, topk, return_scores = validate(body, self.server.limits)
            self.server.count_request()
            if self.server.latency > 0:  # an injected service time (benchmarks, fault tests)
                time.sleep(self.server.latency)
            hits = self.server.retriever.search(queries, topk) if queries else []
        except BadRequest as err:
            self._send(err.status, {"error": str(err)})
            return
        except Exception as err:  # a bug must not kill the server; the client sees a 500
            logger.exception("retrieval failed")
            self._send(500, {"error": f"internal error: {type(err).__name__}: {err}"})
            return
        result = [
            [({"document": {"id": p.id, "contents": p.contents}, "score": p.score} if return_scores
              else {"id": p.id, "contents": p.contents}) for p in passages]
            for passages in hits
        ]
        self._send(200, {"result": result})


class RetrievalServer(ThreadingHTTPServer):
    """A threading HTTP server that answers Search-R1 retrieval requests."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], retriever: Retriever, limits: Limits | None = None, *,
                 latency: float = 0.0) -> None:
        self.retriever = retriever
        self.limits = limits or Limits()
        #: Seconds each /retrieve request waits before it is answered: a slower service, simulated.
        self.latency = float(latency)
        #: Valid /retrieve requests received so far.
        self.requests = 0
        self._count_lock = threading.Lock()
        super().__init__(address, RetrievalHandler)

    def count_request(self) -> None:
        with self._count_lock:
            self.requests += 1

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


def serve(corpus: str | Path | None, host: str, port: int, *, topk: int = 3,
          cache_dir: str | Path | None = None, ready_message: bool = True, latency: float = 0.0) -> None:
    """Build (or load) the index, serve until SIGTERM/SIGINT, then shut down cleanly."""
    if corpus is None:
        from envs.search.kb import default_paths

        corpus = default_paths()["corpus"]
    limits = Limits(default_topk=topk)  # checked before the (possibly long) index build
    retriever = BM25Retriever(corpus, cache_dir=cache_dir)
    server = RetrievalServer((host, port), retriever, limits, latency=latency)

    def stop(signum: int, _frame: Any) -> None:
        logger.info("signal %d: shutting down", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()  # shutdown() blocks; not here

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    if ready_message:
        print(f"serving {len(retriever)} passages from {corpus} at {server.url}/retrieve", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        logger.info("server stopped")


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
