"""The real retrieval server in a subprocess: Search-R1 protocol end to end, bad input, load, outages."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from envs.search import BM25Retriever, HTTPRetriever, RetrievalError, SearchQAEnv, kb

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def search_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("freshper-cache")
    mp.setenv("FRESHPER_CACHE", str(root))
    kb.default_paths()  # generate once, before server and tests race for it
    yield root
    mp.undo()


def _start_server(args: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``python -m envs.search.server`` on a free loopback port; wait for /health."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "envs.search.server", "--host", "127.0.0.1", "--port", "0",
         "--log-level", "WARNING", *(args or [])],
        cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline()  # "serving N passages from ... at http://127.0.0.1:PORT/retrieve"
    if "http://" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read()}")
    base = line.split(" at ")[1].strip().removesuffix("/retrieve")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server never became healthy")


def _stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="module")
def server(search_cache: Path) -> Iterator[str]:
    proc, base = _start_server()
    yield base
    assert _stop(proc) == 0, "the server should exit cleanly on SIGTERM"


def _healthy(base: str) -> bool:
    return httpx.get(f"{base}/health", timeout=5).json()["status"] == "ok"


def test_http_and_in_process_bm25_return_identical_passages(server: str) -> None:
    http = HTTPRetriever(server, timeout=5, retries=0)
    local = BM25Retriever(kb.default_paths()["corpus"])
    queries = [q["question"] for q in kb.generate()[1]["test"][:40]] + ["zzzz unknown words"]
    assert http.search(queries, 3) == local.search(queries, 3)
    assert http.search(queries[:2], 5) == local.search(queries[:2], 5)


def test_episodes_through_http_match_episodes_through_bm25(server: str) -> None:
    via_http = SearchQAEnv(retrieval_url=f"{server}/retrieve", split="test")
    local = SearchQAEnv(split="test")
    for seed in range(5):
        assert via_http.reset(seed=seed) == local.reset(seed=seed)
        question = via_http.question.question
        for reply in [f"<search>{question}</search>", f"<answer>{via_http.question.golden_answers[0]}</answer>"]:
            step_http, step_local = via_http.step(reply), local.step(reply)
            assert step_http == step_local
        assert step_http[1] == 1.0


def test_protocol_without_scores_returns_plain_documents(server: str) -> None:
    reply = httpx.post(f"{server}/retrieve", json={"queries": ["capital"], "topk": 2}, timeout=5).json()
    assert set(reply["result"][0][0]) == {"id", "contents"}
    scored = httpx.post(f"{server}/retrieve", json={"queries": ["capital"], "topk": 2, "return_scores": True}).json()
    assert set(scored["result"][0][0]) == {"document", "score"} and len(scored["result"][0]) == 2


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{not json", 400),
        (b"\xff\xfe", 400),
        (b"[1, 2]", 400),
        (json.dumps({"queries": "one", "topk": 3}).encode(), 400),
        (json.dumps({"queries": [1, 2], "topk": 3}).encode(), 400),
        (json.dumps({"queries": ["a"], "topk": -1}).encode(), 400),
        (b"[" * 100_000 + b"]" * 100_000, 400),  # nested too deeply for the JSON parser
        (json.dumps({"queries": ["a"], "topk": True}).encode(), 400),
        (json.dumps({"queries": ["a"], "topk": "3"}).encode(), 400),
        (json.dumps({"queries": ["a"], "topk": 101}).encode(), 400),
        (json.dumps({"queries": ["a" * 5000], "topk": 3}).encode(), 400),
        (json.dumps({"queries": ["a"], "topk": 3, "return_scores": "yes"}).encode(), 400),
        (b"x" * (2 << 20), 413),
    ],
)
def test_bad_requests_get_a_4xx_with_a_message(server: str, body: bytes, status: int) -> None:
    response = httpx.post(f"{server}/retrieve", content=body, timeout=10)
    assert response.status_code == status
    assert response.json()["error"]
    assert _healthy(server)


def test_raw_socket_abuse_does_not_hurt_the_server(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    for raw in [b"POST /retrieve HTTP/1.1\r\nHost: x\r\n\r\n",  # no Content-Length -> 411
                b"POST /retrieve HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                b"GARBAGE\r\n\r\n",
                b"POST /retrieve HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"q"]:  # then hang up
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(4096)
    assert httpx.get(f"{server}/nowhere").status_code == 404
    assert _healthy(server)


def test_concurrent_load_is_served_and_the_server_stays_healthy(server: str) -> None:
    errors: list[str] = []

    def client(n: int) -> None:
        with httpx.Client(timeout=10) as c:
            for i in range(25):
                r = c.post(f"{server}/retrieve", json={"queries": [f"city {n} {i}", "capital"], "topk": 3})
                if r.status_code != 200 or len(r.json()["result"]) != 2:
                    errors.append(f"{r.status_code}: {r.text[:100]}")

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert _healthy(server)


def test_env_survives_the_server_stopping_mid_episode(search_cache: Path) -> None:
    proc, base = _start_server()
    env = SearchQAEnv(retriever=HTTPRetriever(base, timeout=0.5, retries=1, backoff=0.01))
    env.reset(seed=0)
    assert env.step("<search>capital</search>")[4]["failed"] is False
    assert _stop(proc) == 0
    _, reward, terminated, truncated, info = env.step("<search>capital city</search>")
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert info["failed"] is True and "failed after 2 attempts" in info["error"]


def test_unreachable_url_raises_a_clear_error_after_retries() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nobody listens there
    retriever = HTTPRetriever(f"http://127.0.0.1:{port}", timeout=0.2, retries=2, backoff=0.01)
    start = time.perf_counter()
    with pytest.raises(RetrievalError, match=r"127\.0\.0\.1:\d+/retrieve failed after 3 attempts"):
        retriever.search(["x"], 3)
    assert time.perf_counter() - start < 5
    env = SearchQAEnv(retrieval_url=f"http://127.0.0.1:{port}/retrieve", retrieval_timeout=0.2,
                      retrieval_retries=0, on_retrieval_error="raise")
    env.reset(seed=0)
    with pytest.raises(RetrievalError):
        env.step("<search>x</search>")
