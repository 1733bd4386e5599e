"""The endpoint evaluator (``python -m agents.evaluate --base-url``) against a hostile
OpenAI-compatible server: a real HTTP server on loopback that answers with a 300 MB completion,
an endless chunked stream, a gzip bomb, a trickle of a byte at a time, or fields of the wrong
type. Each must end the episode as failed with a clear reason, within the request timeout and
without holding more than the reply cap in memory; never a traceback."""

from __future__ import annotations

import gzip
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agents import evaluate as ev
from agents.rollout.openai_eval import ChatEndpoint, EndpointRunner, parse_completion
from envs.wire import AnswerError, loads_json

LAKE = "freshper/FrozenLake-v0"
GOOD = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "<answer>Down</answer>"},
                     "finish_reason": "stop",
                     "logprobs": {"content": [{"token": "<answer>", "logprob": -0.5}, {"token": "Down", "logprob": -0.25},
                                              {"token": "</answer>", "logprob": -0.125}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3}}
MB = 1 << 20


def _bomb() -> bytes:
    out = gzip.compress(b'{"choices": [{"message": {"content": "' + b" " * (64 * MB), compresslevel=9)
    assert len(out) < MB // 4
    return out


class Hostile(ThreadingHTTPServer):
    """Answers every chat request with the fault ``mode`` names."""

    daemon_threads = True

    def __init__(self, mode: str, body: bytes = b"") -> None:
        self.mode, self.body, self.stop = mode, body, threading.Event()
        self.requests = 0
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests += 1
        mode, stop = self.server.mode, self.server.stop
        try:
            if mode == "body":
                self._head({"Content-Length": str(len(self.server.body))})
                self.wfile.write(self.server.body)
            elif mode in ("huge", "endless"):  # chunked: 300 MB of one completion, or no end at all
                self._head({"Transfer-Encoding": "chunked"})
                piece = b"a" * MB
                self._chunk(b'{"choices": [{"message": {"content": "')
                sent = 0
                while not stop.is_set() and (mode == "endless" or sent < 300):
                    self._chunk(piece)
                    sent += 1
                self._chunk(b"")
            elif mode == "announced":
                self._head({"Content-Length": str(300 * MB)})
                for _ in range(300):
                    self.wfile.write(b"a" * MB)
            elif mode == "gzip":
                self._head({"Content-Encoding": "gzip", "Content-Length": str(len(self.server.body))})
                self.wfile.write(self.server.body)
            elif mode == "trickle":  # a valid answer, a byte at a time, every 0.1 s
                data = json.dumps(GOOD).encode()
                self._head({"Content-Length": str(len(data))})
                for b in data:
                    if stop.is_set():
                        break
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def _head(self, headers: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def _play(url: str, *, timeout: float = 5.0, max_response_bytes: int = 16 * MB, deadline: float = 20.0):
    """One episode against ``url`` (no retries), in a thread that must end within ``deadline`` s."""
    endpoint = ChatEndpoint(url, "stub", timeout=timeout, max_retries=0, backoff=0.01,
                            max_response_bytes=max_response_bytes)
    runner = EndpointRunner(endpoint, LAKE, env_kwargs={"feedback": False}, concurrency=1)
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = ev.evaluate(None, LAKE, episodes=1, runner=runner, batch_size=1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline)
    assert not thread.is_alive(), f"the episode was still running after {deadline} s"
    assert "error" not in box, f"the evaluation raised {box.get('error')!r}"
    return box["result"].records[0], time.monotonic() - t0


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_300_mb_completion_fails_the_episode_without_holding_it() -> None:
    """A 300 MB completion streamed (chunked) or announced: the episode fails naming the cap,
    and the process holds no more than the cap meanwhile (the old reader held it whole)."""
    base, peak, done = _rss_mb(), [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for mode in ("huge", "announced"):
            with Hostile(mode) as stub:
                rec, _ = _play(stub.url)
            assert rec.failed and "malformed answer" in rec.info["error"], rec.info
            assert "16777216" in rec.info["error"], rec.info["error"]
    finally:
        done.set()
        watcher.join()
    assert peak[0] - base < 200, f"RSS grew by {peak[0] - base:.0f} MB"


def test_an_endless_chunked_stream_and_a_gzip_bomb_are_cut_at_the_cap() -> None:
    for mode, body in (("endless", b""), ("gzip", _bomb())):
        with Hostile(mode, body) as stub:
            rec, took = _play(stub.url, max_response_bytes=MB, deadline=15.0)
        assert rec.failed and f"larger than {MB} bytes" in rec.info["error"], (mode, rec.info)
        assert took < 10, (mode, took)


def test_a_trickled_answer_cannot_outlive_the_request_timeout() -> None:
    """A byte every 0.1 s of a valid answer (~30 s in all) against a 1 s request timeout: the
    request ends at 1 s (the timeout used to be per read, which a trickle never trips)."""
    with Hostile("trickle") as stub:
        rec, took = _play(stub.url, timeout=1.0, deadline=10.0)
    assert rec.failed and "no complete answer within 1 s" in rec.info["error"], rec.info
    assert took < 4, took


MALFORMED = {
    "logprob null": (b'{"choices": [{"message": {"content": "x"}, "logprobs": {"content": [{"token": "x", "logprob": null}]}}]}',
                     "logprobs.content[0].logprob must be a finite number"),
    "logprob a list": (b'{"choices": [{"message": {"content": "x"}, "logprobs": {"content": [{"token": "x", "logprob": [1]}]}}]}',
                       "logprobs.content[0].logprob must be a finite number"),
    "token a number": (b'{"choices": [{"message": {"content": "x"}, "logprobs": {"content": [{"token": 5, "logprob": -1}]}}]}',
                       "logprobs.content[0].token must be a string"),
    "logprobs a list": (b'{"choices": [{"message": {"content": "x"}, "logprobs": [1, 2]}]}', "'logprobs' must be an object"),
    "usage text": (b'{"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": "abc"}}',
                   "usage.prompt_tokens must be a non-negative integer"),
    "usage 1e400": (b'{"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": 1e400}}',
                    "does not fit a float"),
    "usage a list": (b'{"choices": [{"message": {"content": "x"}}], "usage": [1]}', "'usage' must be an object"),
    "usage negative": (b'{"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": -4}}',
                       "usage.prompt_tokens must be a non-negative integer"),
    "NaN": (b'{"choices": [{"message": {"content": "x"}, "logprobs": {"content": [{"token": "x", "logprob": NaN}]}}]}',
            "NaN is not a JSON number"),
    "deep": (b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper than 64 levels"),
    "deep, shallow enough to parse": (b'{"choices": [{"message": {"content": "x"}, "x": ' + b"[" * 500 + b"]" * 500 + b"}]}",
                                      "nests deeper than 64 levels"),
    "huge integer": (b'{"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 1' + b"0" * 5000 + b"}}",
                     "cannot be read as JSON"),
    "content a list": (b'{"choices": [{"message": {"content": [1]}}]}', "message content is not text"),
    "finish_reason a number": (b'{"choices": [{"message": {"content": "x"}, "finish_reason": 3}]}', "'finish_reason'"),
    "a list": (b"[1, 2]", "not a JSON object"),
    "not UTF-8": (b'{"choices": "\xff"}', "not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_each_malformed_field_fails_the_episode_with_its_reason(case: str) -> None:
    body, reason = MALFORMED[case]
    with Hostile("body", body) as stub:
        rec, _ = _play(stub.url)
    assert rec.failed and "malformed answer" in rec.info["error"] and reason in rec.info["error"], rec.info
    assert len(rec.info["error"]) < 1000


def test_fuzzed_answers_parse_or_are_a_clear_value_error() -> None:
    """Seeded mutations of a valid answer (bytes flipped, cut, spliced, values swapped for
    other JSON values) through the evaluator's parser: a completion or a ValueError, never
    another exception."""
    rng = random.Random(54)
    valid = json.dumps(GOOD).encode()
    values = [None, True, -1, 0, 1e308, "x", [], {}, [1, 2], {"a": None}, -0.5, 2**60]

    def mutate_value(v):
        if isinstance(v, dict) and v and rng.random() < 0.7:
            k = rng.choice(list(v))
            return {**v, k: mutate_value(v[k])} if rng.random() < 0.8 else {kk: vv for kk, vv in v.items() if kk != k}
        if isinstance(v, list) and v and rng.random() < 0.7:
            i = rng.randrange(len(v))
            return v[:i] + [mutate_value(v[i])] + v[i + 1:]
        return rng.choice(values)

    outcomes = {"parsed": 0, "refused": 0}
    for _ in range(3000):
        if rng.random() < 0.5:
            raw = json.dumps(mutate_value(GOOD)).encode()
        else:
            raw = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                op, i = rng.random(), rng.randrange(len(raw))
                if op < 0.4:
                    raw[i] = rng.randrange(256)
                elif op < 0.7:
                    del raw[i:i + rng.randint(1, 20)]
                else:
                    raw[i:i] = rng.choice([b"[", b"{", b"1e999", b"NaN", b"\\u0000", b'"', b"-", b"9" * 50])
            raw = bytes(raw)
        try:
            done = parse_completion(loads_json(raw))
        except ValueError as exc:
            assert isinstance(exc, (AnswerError, ValueError)) and str(exc)
            outcomes["refused"] += 1
            continue
        assert isinstance(done.text, str) and all(isinstance(v, int) for v in done.usage.values())
        assert done.tokens is None or all(isinstance(t, str) and isinstance(lp, float) for t, lp in done.tokens)
        outcomes["parsed"] += 1
    assert outcomes["parsed"] > 100 and outcomes["refused"] > 100, outcomes
