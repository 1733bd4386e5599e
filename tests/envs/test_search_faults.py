"""Retrieval faults, each written as its repro: real servers on loopback that trickle, nest, flood
or stall, the Search-R1 trainer's real request shapes, a damaged index cache, bad settings."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gymnasium as gym
import httpx
import pytest

import envs  # noqa: F401  (registers freshper/SearchQA-v0)
from envs.search import BM25Retriever, HTTPRetriever, Passage, RetrievalError, SearchQAEnv
from envs.search.server import Limits, RetrievalServer

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("search_cache")


@contextmanager
def fault_server(respond: Callable[[BaseHTTPRequestHandler, dict], None]) -> Iterator[str]:
    """A loopback HTTP server whose POST handler is ``respond(handler, request_json)``."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                respond(self, body)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up: expected here
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


def _headers(handler: BaseHTTPRequestHandler, length: int | None = None) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    if length is None:
        handler.send_header("Transfer-Encoding", "chunked")
    else:
        handler.send_header("Content-Length", str(length))
    handler.end_headers()


def _chunk(handler: BaseHTTPRequestHandler, data: bytes) -> None:
    handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    handler.wfile.flush()


def _doc(n: int, title: str = "Title", text: str = "text") -> dict:
    return {"document": {"id": str(n), "contents": f"{title}\n{text}"}, "score": 1.0}


def _env(url: str, **kwargs) -> SearchQAEnv:
    kwargs.setdefault("retriever", HTTPRetriever(url, timeout=kwargs.pop("timeout", 5), retries=kwargs.pop("retries", 0),
                                                 backoff=0.01, **kwargs.pop("client_kwargs", {})))
    env = SearchQAEnv(**kwargs)
    env.reset(seed=0)
    return env


# -- 4: a trickling server cannot hold a step past the deadline ----------------------------------
def test_a_server_trickling_a_byte_every_3_s_cannot_hold_a_step_past_the_deadline() -> None:
    body = json.dumps({"result": [[_doc(0)]]}).encode()

    def trickle(handler, _request) -> None:
        _headers(handler, len(body))
        for byte in body:  # each read returns within 3 s, so a per-read timeout never trips
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()
            time.sleep(3)

    with fault_server(trickle) as url:
        env = _env(url, timeout=4, retries=0)
        start = time.perf_counter()
        _, reward, terminated, truncated, info = env.step("<search>x</search>")
        elapsed = time.perf_counter() - start
    assert elapsed < 6, f"the step took {elapsed:.1f} s with a 4 s deadline"
    assert (reward, terminated, truncated, info["failed"]) == (0.0, False, True, True)
    assert "4 s deadline" in info["error"]


def test_the_deadline_bounds_retries_too_and_env_settings_are_validated() -> None:
    def stall(handler, _request) -> None:
        time.sleep(30)  # accepts, never answers

    with fault_server(stall) as url:
        retriever = HTTPRetriever(url, timeout=0.5, retries=2, backoff=0.05)
        start = time.perf_counter()
        with pytest.raises(RetrievalError, match="failed after 3 attempts.*deadline"):
            retriever.search(["x"], 3)
        assert time.perf_counter() - start < 3  # 3 x 0.5 s + 0.15 s of backoff
    for bad in [dict(retrieval_retries=-5), dict(retrieval_timeout=-1), dict(retrieval_timeout=0),
                dict(retrieval_timeout=float("inf")), dict(retrieval_retries=1.5)]:
        with pytest.raises(ValueError, match="retrieval (retries|timeout)"):
            SearchQAEnv(retrieval_url="http://127.0.0.1:9/retrieve", **bad)
    with pytest.raises(ValueError, match="retrieval backoff"):
        HTTPRetriever("http://127.0.0.1:9", backoff=-1)


# -- 5: malformed answers are failed episodes, never exceptions out of step -------------------------
@pytest.mark.parametrize("payload", [
    b'{"result": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",  # RecursionError in json.loads before
    b'{"result": [["not a document"]]}',
    b'{"result": [[{"document": "str"}]]}',
    b'{"result": [[{"document": {"id": 1, "contents": "T\\nx"}, "score": "high"}]]}',
    b'{"result": {}}',
    b'{"result": [1]}',
    b"\xff\xfe not utf-8",
    b"null",
])
def test_a_malformed_answer_ends_the_episode_as_failed(payload: bytes) -> None:
    def answer(handler, _request) -> None:
        _headers(handler, len(payload))
        handler.wfile.write(payload)

    with fault_server(answer) as url:
        env = _env(url)
        _, reward, terminated, truncated, info = env.step("<search>x</search>")
    assert (reward, terminated, truncated, info["failed"]) == (0.0, False, True, True)
    assert "malformed answer" in info["error"]


# -- 6: caps on what a server returns ---------------------------------------------------------------
def test_passages_are_capped_to_topk_and_titles_truncated() -> None:
    flood = {"result": [[_doc(n, title="T" * 100_000, text="word " * 50_000) for n in range(50)]]}
    data = json.dumps(flood).encode()  # ~40 MB of answer for one query: refused by default

    def answer(handler, _request) -> None:
        _headers(handler, len(data))
        handler.wfile.write(data)

    with fault_server(answer) as url:
        env = _env(url, client_kwargs={"max_response_bytes": 64 << 20})
        obs, _, _, _, info = env.step("<search>x</search>")
        assert not info["failed"]
        text = obs["text"]
        assert text.count("Doc ") == 3 and "Doc 4" not in text  # topk=3 of the 50 sent
        assert len(text) < 3 * (200 + 400 + 40) + 1_000, len(text)  # titles 200, texts 400 chars
        assert max(len(t) for t in env._last_titles) <= 200
        default = _env(url)
        _, _, _, truncated, info = default.step("<search>x</search>")
        assert truncated and info["failed"] and "max_response_bytes" in info["error"]


def test_a_huge_streamed_answer_is_cut_off_without_holding_it_in_memory() -> None:
    piece = b" " * (1 << 20)

    def answer(handler, _request) -> None:  # 300 MB of whitespace, then a valid answer
        _headers(handler)
        _chunk(handler, b'{"result": [')
        for _ in range(300):
            _chunk(handler, piece)
        _chunk(handler, b"[]]}")
        _chunk(handler, b"")

    with fault_server(answer) as url:
        retriever = HTTPRetriever(url, timeout=30, retries=0, max_response_bytes=8 << 20)
        tracemalloc.start()
        try:
            with pytest.raises(RetrievalError, match="more than max_response_bytes=8388608"):
                retriever.search(["x"], 3)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 40 << 20, f"peak {peak / 2**20:.0f} MB"


# -- the Search-R1 trainer's requests against our server -----------------------------------------
@pytest.fixture(scope="module")
def local_server(tmp_path_factory) -> Iterator[str]:
    passages = [Passage(str(i), f"Doc{i}", f"capital city number {i} river") for i in range(20)]
    server = RetrievalServer(("127.0.0.1", 0), BM25Retriever(passages, cache_dir=tmp_path_factory.mktemp("idx")),
                             Limits(request_timeout=1.0))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server.url
    server.shutdown()
    server.server_close()


def test_search_r1s_empty_batch_and_topk_0_are_answered_as_its_server_does(local_server: str) -> None:
    # Search-R1's generation manager posts every turn, also when no rollout searched, and reads
    # response.json()["result"] (a KeyError on our former 400).
    payload = {"queries": [], "topk": 3, "return_scores": True}
    response = httpx.post(f"{local_server}/retrieve", json=payload, timeout=5)
    assert response.status_code == 200 and response.json()["result"] == []
    for topk in (0, None):  # both mean the server's default (3)
        body = {"queries": ["capital city"], "topk": topk, "return_scores": True}
        result = httpx.post(f"{local_server}/retrieve", json=body, timeout=5).json()["result"]
        assert len(result) == 1 and len(result[0]) == 3


def test_a_client_stalled_mid_body_gets_408_and_the_server_stays_up(local_server: str) -> None:
    host, port = local_server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"queries\"")
        start = time.perf_counter()
        chunks = []
        while chunk := sock.recv(4096):  # the server closes the connection after its answer
            chunks.append(chunk)
        reply = b"".join(chunks).decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 1.0 s" in reply
    assert time.perf_counter() - start < 5
    assert httpx.get(f"{local_server}/health", timeout=5).json()["status"] == "ok"


@pytest.mark.parametrize("topk", ["0", "500", "-3"])
def test_the_server_refuses_to_start_with_a_default_topk_it_would_reject(topk: str) -> None:
    result = subprocess.run([sys.executable, "-m", "envs.search.server", "--port", "0", "--topk", topk],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"--topk must be from 1 to 100, got {topk}" in result.stderr
    with pytest.raises(ValueError, match="default topk must be from 1 to 100"):
        Limits(default_topk=int(topk))


# -- 11: a damaged index cache is rebuilt ------------------------------------------------------------
def test_a_truncated_file_in_the_index_cache_is_rebuilt(tmp_path: Path, search_cache: Path) -> None:
    envs.search.env._SHARED.clear()
    env = gym.make("freshper/SearchQA-v0")  # builds and caches the default corpus's index
    index_root = search_cache / "search" / "index"
    (folder,) = [p for p in index_root.iterdir() if not p.name.startswith(".")]
    files = sorted(p for p in folder.iterdir() if p.is_file())
    assert len(files) >= 3
    from envs.search import kb

    corpus = kb.default_paths()["corpus"]
    expected = BM25Retriever(corpus).search(["capital", "born river"], 3)
    for victim in files:
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])  # e.g. a disk that filled up mid-write
        envs.search.env._SHARED.clear()
        rebuilt = BM25Retriever(corpus)
        assert rebuilt.search(["capital", "born river"], 3) == expected, victim.name
        env = gym.make("freshper/SearchQA-v0")
        env.reset(seed=0)
        assert not env.step("<search>capital</search>")[4]["failed"]
        files = sorted(p for p in folder.iterdir() if p.is_file())  # the rebuilt cache


def test_an_intact_index_cache_is_reused_not_rebuilt(tmp_path: Path, caplog) -> None:
    from envs.search import kb

    corpus = kb.default_paths()["corpus"]
    BM25Retriever(corpus, cache_dir=tmp_path)  # builds and caches
    (folder,) = list(tmp_path.iterdir())
    stamp = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with caplog.at_level("INFO", logger="envs.search.retriever"):
        BM25Retriever(corpus, cache_dir=tmp_path)
    assert "damaged" not in caplog.text and "built BM25 index" not in caplog.text
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamp


def test_429_and_5xx_are_retried_and_other_4xx_fail_at_once() -> None:
    calls = {"n": 0}
    good = json.dumps({"result": [[_doc(0, title="Found")]]}).encode()

    def flaky(handler, _request) -> None:
        calls["n"] += 1
        status, body = (503, b'{"error": "busy"}') if calls["n"] == 1 else (429, b"{}") if calls["n"] == 2 else (200, good)
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    with fault_server(flaky) as url:
        assert HTTPRetriever(url, timeout=5, retries=2, backoff=0.01).search(["x"], 3)[0][0].title == "Found"
        assert calls["n"] == 3

    def refuse(handler, _request) -> None:
        calls["n"] += 1
        body = b'{"error": "bad topk"}'
        handler.send_response(400)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    calls["n"] = 0
    with fault_server(refuse) as url:
        with pytest.raises(RetrievalError, match="rejected the request: HTTP 400: .*bad topk"):
            HTTPRetriever(url, timeout=5, retries=3, backoff=0.01).search(["x"], 3)
        assert calls["n"] == 1
