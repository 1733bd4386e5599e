"""``python -m envs.serve`` against hostile clients, on real servers on loopback: a request
trickled a byte at a time (headers or body) gets its 408 at ``request_timeout``, a thousand
idle connections hold at most ``max_connections`` threads and honest clients are still served,
and fuzzed request bodies are always a 2xx or a 4xx with a message, never a 500."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import gymnasium as gym
import httpx
import pytest

import envs  # noqa: F401
from envs.serve import Limits

from conftest import Served

LAKE = "freshper/FrozenLake-v0"


def _trickle(address, data: bytes, every: float, give_up: float) -> tuple[bytes, float]:
    """Send ``data`` a byte every ``every`` s (then nothing) until the server answers or closes;
    what it sent and when, or what it had sent by ``give_up`` s."""
    t0 = time.monotonic()
    with socket.create_connection(address) as sock:
        sock.settimeout(every)
        got, i = b"", 0
        while time.monotonic() - t0 < give_up:
            if i < len(data):
                try:
                    sock.sendall(data[i:i + 1])
                except OSError:
                    break
                i += 1
            try:
                chunk = sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                break
            if not chunk:
                break
            got += chunk
        return got, time.monotonic() - t0


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_request_trickled_byte_by_byte_gets_a_408_at_the_request_timeout(part: str) -> None:
    """A byte every 0.2 s never trips a 1 s timeout per read; the deadline is the whole request's."""
    head = b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n"
    with Served(limits=Limits(request_timeout=1.0)) as served:
        address = served.server.server_address[:2]
        if part == "headers":
            got, took = _trickle(address, head + b"X-Padding: " + b"a" * 100, 0.2, 6.0)
        else:
            with socket.create_connection(address) as sock:  # headers at once, then the body trickled
                sock.sendall(head + b"\r\n")
                sock.settimeout(0.2)
                t0, got = time.monotonic(), b""
                while time.monotonic() - t0 < 6.0 and not got:
                    try:
                        sock.sendall(b" ")
                        got = sock.recv(4096)
                        if not got:
                            break
                    except socket.timeout:
                        continue
                    except OSError:
                        break
                took = time.monotonic() - t0
        assert took < 2.5, f"the connection was still open after {took:.1f} s"
        assert b" 408 " in got.split(b"\r\n")[0], got[:200]
        assert httpx.get(served.url + "/health").status_code == 200


def test_a_thousand_idle_connections_hold_at_most_max_connections_threads() -> None:
    """1,000 connections that send nothing used to make 1,000 threads; now at most the limit
    (256), the longest-idle closed for each newcomer, and an honest client plays on."""
    with Served() as served:
        env = gym.make("freshper/Remote-v0", url=served.url)
        env.reset(seed=0)
        base = threading.active_count()
        socks, peak = [], 0
        try:
            for k in range(1000):
                socks.append(socket.create_connection(served.server.server_address[:2]))
                if k % 50 == 0:
                    peak = max(peak, threading.active_count())
            time.sleep(0.5)
            peak = max(peak, threading.active_count())
            assert peak - base <= 256 + 8, f"{peak - base} threads for 1,000 idle connections"
            assert served.server.connections <= 256 + 8
            t0 = time.monotonic()
            assert httpx.get(served.url + "/health", timeout=5).status_code == 200
            *_, info = env.step("<answer>Down</answer>")
            assert not info.get("failed") and time.monotonic() - t0 < 3, info
        finally:
            for s in socks:
                s.close()
            env.close()


def test_when_every_connection_is_busy_a_new_one_gets_a_503() -> None:
    with Served(limits=Limits(max_connections=2, request_timeout=3.0)) as served:
        address = served.server.server_address[:2]
        busy = [socket.create_connection(address) for _ in range(2)]
        for s in busy:  # mid-request: not idle, so not closed for a newcomer
            s.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.3)
        resp = httpx.get(served.url + "/health", timeout=5)
        assert resp.status_code == 503 and "limit of 2 connections" in resp.json()["error"]
        assert resp.headers["retry-after"] == "1"
        for s in busy:
            s.close()
        deadline = time.monotonic() + 5
        while served.server.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(served.url + "/health", timeout=5).status_code == 200


def test_fuzzed_request_bodies_are_answered_2xx_or_4xx_never_500() -> None:
    """Seeded mutations of valid bodies of every endpoint (bytes flipped, cut, spliced; values
    swapped for other JSON values): each is answered 2xx, or 4xx with a short message."""
    rng = random.Random(54)
    values = [None, True, -1, 0, 2**70, 1e308, "x", "x" * 5000, [], {}, [1, 2], {"a": [1]}, "render_text"]

    def mutate_value(v):
        if isinstance(v, dict) and v and rng.random() < 0.75:
            k = rng.choice(list(v))
            return {**v, k: mutate_value(v[k])} if rng.random() < 0.8 else {kk: vv for kk, vv in v.items() if kk != k}
        if isinstance(v, list) and v and rng.random() < 0.6:
            i = rng.randrange(len(v))
            return v[:i] + [mutate_value(v[i])] + v[i + 1:]
        return rng.choice(values)

    statuses: dict[int, int] = {}
    with Served(limits=Limits(max_sessions=8)) as served, httpx.Client(base_url=served.url, timeout=30) as client:
        sid = client.post("/sessions", json={}).json()["session"]
        client.post(f"/sessions/{sid}/reset", json={"seed": 0})
        valid = [("/sessions", {"kwargs": {"size": 4}}),
                 (f"/sessions/{sid}/reset", {"seed": 3, "options": None}),
                 (f"/sessions/{sid}/step", {"action": "<answer>Down</answer>"}),
                 (f"/sessions/{sid}/call", {"method": "format_reply", "args": ["Down"]}),
                 (f"/sessions/{sid}/call", {"method": "legal_actions", "args": []}),
                 ("/batch", {"calls": [{"session": sid, "op": "step", "action": "<answer>Up</answer>"},
                                       {"session": sid, "op": "reset", "seed": 1}]})]
        for _ in range(600):
            path, body = rng.choice(valid)
            if rng.random() < 0.6:
                raw = json.dumps(mutate_value(body)).encode()
            else:
                raw = bytearray(json.dumps(body).encode())
                for _ in range(rng.randint(1, 3)):
                    op, i = rng.random(), rng.randrange(len(raw))
                    if op < 0.4:
                        raw[i] = rng.randrange(256)
                    elif op < 0.7:
                        del raw[i:i + rng.randint(1, 10)]
                    else:
                        raw[i:i] = rng.choice([b"[", b"{", b"1e999", b"NaN", b'"', b"9" * 5000, b"\\ud800"])
                raw = bytes(raw)
            resp = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            assert resp.status_code < 500 or resp.status_code == 503, (path, raw[:300], resp.text[:300])
            answer = resp.json()
            assert isinstance(answer, dict)
            if resp.status_code >= 400:
                assert isinstance(answer["error"], str) and len(answer["error"]) <= 2500, answer
            if path == "/sessions" and resp.status_code == 200:
                client.delete(f"/sessions/{answer['session']}")
            if resp.status_code == 409 or (resp.status_code == 200 and answer.get("terminated")):
                client.post(f"/sessions/{sid}/reset", json={"seed": 0})
    assert statuses.get(200, 0) > 50 and statuses.get(400, 0) > 100, statuses


def test_three_sessions_scoring_answers_that_never_finish_do_not_hold_up_an_honest_one() -> None:
    """Three sessions answering 9**9**9 kept one shared scoring worker busy to the time limit
    each, one after another: an honest answer waited 33 s. Answers are scored by a pool of
    workers now, so the honest one is scored while the three run out their time."""
    pytest.importorskip("reasoning_gym")
    with Served("freshper/Countdown-v0", kwargs={"score_timeout": 4.0}, limits=Limits(max_sessions=8)) as served:
        clients = [gym.make("freshper/Remote-v0", url=served.url, client_timeout=60) for _ in range(4)]
        for k, env in enumerate(clients):
            env.reset(seed=k)
        warm = [threading.Thread(target=env.step, args=("<answer>1</answer>",)) for env in clients]
        for t in warm:  # four answers at once: the pool's workers are started
            t.start()
        for t in warm:
            t.join()
        for k, env in enumerate(clients):
            env.reset(seed=10 + k)
        hostile = [threading.Thread(target=env.step, args=("<answer>9**9**9</answer>",)) for env in clients[:3]]
        for t in hostile:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        _, _, _, _, info = clients[3].step("<answer>1 + 2</answer>")
        took = time.monotonic() - t0
        for t in hostile:
            t.join(30)
        assert not info.get("score_error"), info
        assert took < 3.0, f"the honest answer took {took:.1f} s"
        for env in clients:
            env.close()


def test_headers_past_64_kib_get_a_431_and_an_idle_connection_is_closed_at_the_request_timeout() -> None:
    with Served(limits=Limits(request_timeout=0.5)) as served:
        address = served.server.server_address[:2]
        with socket.create_connection(address) as sock:  # headers sent at once, past the cap
            sock.settimeout(5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * (70 << 10) + b"\r\n")
            got = sock.recv(4096)
            assert b" 431 " in got.split(b"\r\n")[0] and b"exceed 65536 bytes" in got, got[:300]
        with socket.create_connection(address) as sock:  # connected, then nothing: closed, no answer
            sock.settimeout(5)
            t0 = time.monotonic()
            assert sock.recv(4096) == b"" and time.monotonic() - t0 < 2.0
        assert httpx.get(served.url + "/health").status_code == 200


def test_a_client_keeps_one_connection_and_reconnects_when_the_server_closed_it_idle() -> None:
    with Served(limits=Limits(request_timeout=0.3)) as served:
        env = gym.make("freshper/Remote-v0", url=served.url)
        env.reset(seed=0)
        for _ in range(5):
            *_, info = env.step("<answer>Left</answer>")
            assert not info.get("failed"), info
        assert served.server.connections == 1  # every request on one keep-alive connection
        time.sleep(0.8)  # idle past request_timeout: the server closes it
        assert served.server.connections == 0
        *_, info = env.step("<answer>Left</answer>")  # a fresh connection, not a failed step
        assert not info.get("failed"), info
        env.close()
