"""The remote client (``freshper/Remote-v0``, ``freshper/RemoteVision-v0``) against a hostile task
server: a real HTTP server on loopback that opens a session as ``python -m envs.serve`` does and
then answers steps with wrong shapes, wrong types, images that are not PNGs or claim 400
megapixels, non-finite rewards, a 200 MB chunked or gzip-bombed body, or a trickle. Every one
is a failed step (``info["failed"]``, the reason in ``info["error"]``) within ``client_timeout``
and without holding more than ``max_response_bytes``; nothing raises out of ``env.step``."""

from __future__ import annotations

import base64
import gzip
import json
import random
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gymnasium as gym
import numpy as np
import pytest

import envs  # noqa: F401
from envs.remote import RemoteEnvError
from envs.serve import encode_image

MB = 1 << 20
IMAGE = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
OBS = {"text": "a board", "image": encode_image(IMAGE)}
STEP = {"observation": OBS, "reward": 1.0, "terminated": False, "truncated": False, "info": {"success": False}}


def _png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + b"\x00\x00\x00\x00IEND\xaeB`\x82")


class Hostile(ThreadingHTTPServer):
    """Opens sessions and resets honestly; answers steps as ``mode`` says."""

    daemon_threads = True

    def __init__(self, mode: str = "json", body: bytes = b"", status: int = 200) -> None:
        self.mode, self.body, self.status, self.stop = mode, body, status, threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

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

    def _answer(self, status: int, data: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        for k, v in (headers or {"Content-Length": str(len(data))}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_DELETE(self) -> None:  # noqa: N802
        self._answer(200, b"{}")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server, path = self.server, self.path
        if path == "/sessions":
            return self._answer(200, json.dumps({"session": "s1", "task": "hostile", "modality": "vision",
                                                 "image_shape": [8, 8, 3], "max_text_length": 1000}).encode())
        if path.endswith("/reset"):
            return self._answer(200, json.dumps({"observation": OBS, "info": {}}).encode())
        try:
            if server.mode == "json":
                self._answer(server.status, server.body)
            elif server.mode == "chunked":  # 200 MB, 1 MB at a time
                self._answer(200, b"", {"Transfer-Encoding": "chunked"})
                self.wfile.write(b"%x\r\n%s\r\n" % (len(b'{"observation": {"text": "'), b'{"observation": {"text": "'))
                piece = b"%x\r\n%s\r\n" % (MB, b"a" * MB)
                for _ in range(200):
                    if server.stop.is_set():
                        break
                    self.wfile.write(piece)
                self.wfile.write(b"0\r\n\r\n")
            elif server.mode == "gzip":
                self._answer(200, server.body, {"Content-Encoding": "gzip", "Content-Length": str(len(server.body))})
            elif server.mode == "trickle":  # a valid answer, a byte every 0.1 s
                data = json.dumps(STEP).encode()
                self._answer(200, b"", {"Content-Length": str(len(data))})
                for b in data:
                    if server.stop.is_set():
                        break
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = server.mode != "json"


def _step(stub: Hostile, deadline: float = 20.0, **kwargs):
    """A vision client of ``stub``: reset, then one step, in a thread that must end in ``deadline`` s."""
    env = gym.make("freshper/RemoteVision-v0", url=stub.url, client_retries=0, **kwargs)
    env.reset(seed=0)
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = env.step("<answer>Down</answer>")
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t0 = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline)
    assert not thread.is_alive(), f"env.step was still running after {deadline} s"
    took = time.monotonic() - t0
    env.close()
    assert "error" not in box, f"env.step raised {box.get('error')!r}"
    return box["out"], took


def _image(png: bytes, shape=(8, 8, 3)) -> dict:
    return {"png": base64.b64encode(png).decode(), "shape": list(shape)}


def _with(**fields) -> bytes:
    return json.dumps({**STEP, **fields}).encode()


MALFORMED = {
    "an empty object": (200, b"{}", "observation must be an object with a 'text' string"),
    "a list": (200, b"[1, 2]", "not a JSON object"),
    "a 500 whose body is a list": (500, b"[1, 2]", "answered 500 with [1, 2], not a JSON object"),
    "a 500 whose error is a list": (500, b'{"error": [1]}', "500 {'error': [1]}"),
    "not base64": (200, _with(observation={"text": "t", "image": {"png": "%%%not base64", "shape": [8, 8, 3]}}),
                   "not valid base64"),
    "not a PNG": (200, _with(observation={"text": "t", "image": _image(b"GIF89a" + b"\0" * 64)}), "not a PNG"),
    "a 20000x20000 PNG header": (200, _with(observation={"text": "t", "image": _image(_png_header(20000, 20000),
                                                                                      (20000, 20000, 3))}),
                                 "20000x20000 pixels"),
    "a PNG of another shape": (200, _with(observation={"text": "t", "image": _image(_png_header(9, 8))}),
                               "expected [8, 8, 3]"),
    "a damaged PNG": (200, _with(observation={"text": "t", "image": _image(_png_header(8, 8))}), "cannot be decoded"),
    "an image that is a list": (200, _with(observation={"text": "t", "image": [1]}), "an image must be an object"),
    "reward NaN": (200, _with(reward="__NAN__").replace(b'"__NAN__"', b"NaN"), "NaN is not a JSON number"),
    "reward 1e999": (200, _with(reward="__INF__").replace(b'"__INF__"', b"1e999"), "does not fit a float"),
    "reward the string 1e999": (200, _with(reward="1e999"), "'reward' must be a finite number"),
    "reward true": (200, _with(reward=True), "'reward' must be a finite number"),
    "a list info": (200, _with(info=[1, 2]), "'info' must be an object"),
    "terminated a string": (200, _with(terminated="yes"), "'terminated' and 'truncated' must be true or false"),
    "text a number": (200, _with(observation={"text": 5}), "'text' string"),
    "deep JSON": (200, b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64 levels"),
    "an integer of 5,000 digits": (200, _with(reward=0).replace(b'"reward": 0', b'"reward": 1' + b"0" * 5000),
                                   "cannot be read as JSON"),
    "not UTF-8": (200, b'{"observation": "\xff"}', "not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_each_malformed_step_answer_is_a_failed_step_saying_why(case: str) -> None:
    status, body, reason = MALFORMED[case]
    with Hostile("json", body, status) as stub:
        (obs, reward, terminated, truncated, info), _ = _step(stub)
    assert info.get("failed") and reason in info["error"], info
    assert terminated and reward == 0.0 and len(info["error"]) < 3000
    assert np.array_equal(obs["image"], IMAGE)  # the last good observation


def test_a_200_mb_chunked_or_gzip_answer_is_cut_at_max_response_bytes() -> None:
    bomb = gzip.compress(b'{"observation": {"text": "' + b" " * (200 * MB), compresslevel=9)
    assert len(bomb) < MB
    for mode, body in (("chunked", b""), ("gzip", bomb)):
        with Hostile(mode, body) as stub:
            (_, _, _, _, info), took = _step(stub, max_response_bytes=MB)
        assert info.get("failed") and f"larger than {MB} bytes" in info["error"], (mode, info)
        assert took < 5, (mode, took)


def test_client_timeout_bounds_a_trickled_answer() -> None:
    """A valid answer trickled a byte every 0.1 s (about 20 s in all) against client_timeout=1:
    the step fails at 1 s (the timeout was per read, which a trickle never trips)."""
    with Hostile("trickle") as stub:
        (_, _, _, _, info), took = _step(stub, client_timeout=1.0)
    assert info.get("failed") and "no complete answer within client_timeout=1 s" in info["error"], info
    assert took < 3, took


def test_a_malformed_session_or_call_answer_is_a_clear_remote_env_error() -> None:
    with Hostile("json", b"[1, 2]") as stub:
        env = gym.make("freshper/RemoteVision-v0", url=stub.url, client_retries=0)
        with pytest.raises(RemoteEnvError, match="not a JSON object"):
            env.unwrapped.legal_actions()
        with pytest.raises(RemoteEnvError, match="not a JSON object"):
            env.unwrapped.render_image()
        stub.body = b'{"result": "abc"}'
        with pytest.raises(RemoteEnvError, match="the answer to legal_actions must be a list"):
            env.unwrapped.legal_actions()
        stub.body = b'{"result": {"png": "AAAA", "shape": [8, 8, 3]}}'
        with pytest.raises(RemoteEnvError, match="malformed render_image answer: the image is not a PNG"):
            env.unwrapped.render_image()
        env.close()


def test_fuzzed_step_answers_are_steps_or_failed_steps_never_exceptions() -> None:
    """Seeded mutations of a valid step answer (bytes flipped, cut, spliced; values swapped for
    other JSON values), some over HTTP from the stub and the rest through the client's parser:
    every step returns, either well-typed or failed with a reason."""
    rng = random.Random(54)
    valid = json.dumps(STEP).encode()
    values = [None, True, -1, 0.5, 1e308, "x", "1e999", [], {}, [1, 2], {"png": "x"}, 2**70]

    def mutate_value(v):
        if isinstance(v, dict) and v and rng.random() < 0.75:
            k = rng.choice(list(v))
            return {**v, k: mutate_value(v[k])} if rng.random() < 0.8 else {kk: vv for kk, vv in v.items() if kk != k}
        if isinstance(v, list) and v and rng.random() < 0.5:
            i = rng.randrange(len(v))
            return v[:i] + [mutate_value(v[i])] + v[i + 1:]
        return rng.choice(values)

    def mutated() -> bytes:
        if rng.random() < 0.6:
            return json.dumps(mutate_value(STEP)).encode()
        raw = bytearray(valid)
        for _ in range(rng.randint(1, 3)):
            op, i = rng.random(), rng.randrange(len(raw))
            if op < 0.4:
                raw[i] = rng.randrange(256)
            elif op < 0.7:
                del raw[i:i + rng.randint(1, 30)]
            else:
                raw[i:i] = rng.choice([b"[", b"{", b"1e999", b"NaN", b'"', b"-", b"9" * 40])
        return bytes(raw)

    def check(out) -> str:
        obs, reward, terminated, truncated, info = out
        assert isinstance(obs, dict) and isinstance(obs["text"], str) and isinstance(info, dict)
        assert isinstance(reward, float) and np.isfinite(reward)
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
        if info.get("failed"):
            assert isinstance(info["error"], str) and info["error"]
            return "failed"
        assert obs["image"].shape == (8, 8, 3)
        return "ok"

    seen = {"ok": 0, "failed": 0}
    with Hostile("json", valid) as stub:
        env = gym.make("freshper/RemoteVision-v0", url=stub.url, client_retries=0)
        env.reset(seed=0)
        inner = env.unwrapped
        for k in range(2500):
            stub.body = mutated()
            if k < 200:  # over HTTP, the whole path
                seen[check(inner.step("<answer>Down</answer>"))] += 1
            else:  # the same parsing as _request, then the step's checks
                from envs.wire import AnswerError, loads_json

                try:
                    answer = loads_json(stub.body)
                except AnswerError as exc:
                    seen[check(inner._failed_step(str(exc)))] += 1
                    continue
                seen[check(inner._finish(answer))] += 1
        env.close()
    assert seen["ok"] > 50 and seen["failed"] > 500, seen
