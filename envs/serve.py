"""A registered task as a network service: one env per session, over HTTP/1.1 and JSON, on uvicorn.

    python -m envs.serve freshper/FrozenLake-v0 --port 8000 [--host 127.0.0.1] [--max-sessions 64]
        [--idle-timeout 300] [--max-message-bytes 8388608] [--request-timeout 30] [--max-connections 256]
        [--kw size=6 ...]
        [--allow-client-kwargs | --lock-kwargs] [--no-inline]

The client is :class:`envs.remote.RemoteEnv`, itself a ``gymnasium.Env``:
``gym.make("freshper/Remote-v0", url="http://127.0.0.1:8000")`` (``freshper/RemoteVision-v0``
for a vision task), so the runner, ``train.py`` and Ray workers play a served task as if it
were local. The server is uvicorn (httptools' parser, uvloop where installed; keep-alive
connections) under the shared lifecycle and connection limits of :mod:`envs.asgi`; a request's
work (decoding its body, the task's step, encoding the answer) runs in a pool of threads, except
the calls a task declares quick (``quick_calls``: a FrozenLake step), answered on the event loop
(``--no-inline``: in the pool too).

The protocol (``freshper-env/1``; every body is a JSON object, every answer too):

=================================  ==============================================================
``GET /health``                    ``{"status": "ok", "task", "sessions", "max_sessions"}``
``GET /info``                      the task: ``protocol``, ``task``, ``modality``, ``description``,
                                   ``kwargs`` (the server's), ``client_kwargs`` (what clients may
                                   set: ``"declared"``, ``"any"`` or ``"none"``),
                                   ``allowed_kwargs`` (the task's allow-list with its bounds),
                                   ``limits``
``POST /sessions``                 ``{"kwargs": {...}}`` (optional) -> ``{"session", "modality",
                                   "markov_state", "image_shape", "max_text_length", ...}``; one
                                   new env built with the server's kwargs updated by these
``POST /sessions/<id>/reset``      ``{"seed": int | null, "options": {...} | null}`` ->
                                   ``{"observation", "info"}``
``POST /sessions/<id>/step``       ``{"action": str}`` -> ``{"observation", "reward", "terminated",
                                   "truncated", "info"}``
``POST /sessions/<id>/call``       ``{"method": name, "args": [...]}`` -> ``{"result"}``: the task
                                   contract's text methods (``render_text``, ``legal_actions``,
                                   ``format_reply``, ``lookahead_text``, ...; :data:`CALLS`)
``DELETE /sessions/<id>``          closes the session's env
``POST /batch``                    ``{"calls": [{"session", "op": "reset"|"step", ...}, ...]}`` ->
                                   ``{"results": [...]}``: a whole turn of many sessions in one
                                   round trip (each result is the op's answer or ``{"error",
                                   "status"}``)
=================================  ==============================================================

Observations are ``{"text": str}`` plus, for vision tasks, ``"image": {"png": base64, "shape":
[H, W, 3]}`` (PNG: lossless, so the client's array equals the server's bit for bit).

Limits, each refused with a 4xx/5xx and ``{"error": "..."}`` saying what to do: at most
``max_sessions`` open sessions (503; idle sessions are closed after ``idle_timeout`` seconds
without a request, and a request to a closed one is a 404), request bodies up to
``max_message_bytes`` (413), a request not in within ``request_timeout`` from its first byte
(headers and body together, however it is paced) gets a 408, request line and headers beyond
64 KiB a 431, at most ``max_connections`` connections (the longest-idle one is closed for a new
one, a 503 when every one is busy), JSON nested too deeply or of the wrong shape a 400, a batch
of more than ``max_sessions`` calls a 400. A task error
while building, resetting or stepping is a 400 (bad kwargs) or 500 with the exception's text;
the server keeps serving. SIGTERM and SIGINT stop it cleanly.

Client kwargs: a client sets only what the task declares it may (``client_kwargs`` of the task
class, each with bounds: FrozenLake's ``size`` up to 12, an episode's turns, ...), checked here
before the env is built; anything else is a 403, a value out of bounds a 400. A task's
``server_kwargs`` (where and how answers are scored, the scoring worker's limits) are never a
client's. ``--allow-client-kwargs`` lets clients set other kwargs too (trusted clients only: a
kwarg can name a file or size a task without bound), the bounds and ``server_kwargs`` still
hold; ``--lock-kwargs`` refuses every client kwarg. A served task is built with the class's
``served_kwargs`` beneath the server's ``--kw``: a reasoning task scores every answer in its
worker process, so nothing an answer or a client controls is computed in the server's process.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import math
import struct
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from envs.asgi import HTTPServer, Refused, parse_json, read_body, send_json, serve_until_signal
from envs.asgi import Limits as HTTPLimits

logger = logging.getLogger(__name__)

PROTOCOL = "freshper-env/1"
#: The task contract's methods a client may call on its session's env (text in, JSON out).
CALLS = ("instructions", "state_text", "render_text", "legal_actions", "effective_actions", "format_reply",
         "describe_action", "outcome_text", "lookahead_text", "aim_text", "subgoal_text", "subgoal_moves",
         "tokenizer_text", "render_image", "skips_noop_moves")


def _answer(task: Any, method: str, args: list) -> Any:
    """``task``'s answer to a call of :data:`CALLS`: an optional capability (envs.capabilities)
    through its accessor, so a task without it answers the default, or a ``MissingCapability``
    (``NotImplementedError``, a 501) where there is none."""
    from envs import capabilities

    if method in ("outcome_text", "tokenizer_text"):
        return getattr(capabilities, method)(task, *args)
    need = {"lookahead_text": capabilities.Lookahead, "aim_text": capabilities.Aim,
            "subgoal_text": capabilities.Subgoal, "subgoal_moves": capabilities.SubgoalMoves}.get(method)
    if need is not None:
        capabilities.require(task, need)
    return getattr(task, method)(*args)


@dataclass(frozen=True)
class Limits:
    """What one server allows; anything beyond is refused with a clear error."""

    max_sessions: int = 64
    #: Seconds without a request after which a session's env is closed.
    idle_timeout: float = 300.0
    max_message_bytes: int = 8 << 20
    #: Seconds a request may take to arrive, from its first byte to its last (a 408 past
    #: them), and that a connection may stay idle between requests.
    request_timeout: float = 30.0
    #: Open connections at most; past it the longest-idle connection is closed for a new one,
    #: or the new one is answered 503 when none is idle.
    max_connections: int = 256

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.idle_timeout > 0:
            raise ValueError(f"idle_timeout must be > 0 seconds, got {self.idle_timeout}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


class Busy(Exception):
    """A session another request holds, met by a call that does not wait (``done``: in a batch,
    the answers of the calls before it)."""

    done: list | None = None


class ServeError(Exception):
    """A request the server refuses: an HTTP status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# -- wire encoding (shared with envs.remote) --------------------------------------------------
def encode_image(image: Any) -> dict[str, Any]:
    """A uint8 (H, W, 3) array as ``{"png": base64, "shape": [H, W, 3]}`` (lossless)."""
    from PIL import Image

    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"images must be uint8 (H, W, 3), got {arr.dtype} {arr.shape}")
    buf = io.BytesIO()
    Image.fromarray(arr, mode="RGB").save(buf, format="PNG", compress_level=1)
    return {"png": base64.b64encode(buf.getvalue()).decode("ascii"), "shape": list(arr.shape)}


#: Largest image a client decodes (pixels, checked from the PNG header before decoding).
MAX_IMAGE_PIXELS = 16_000_000
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's header, without decoding; ``ValueError`` if it is not one."""
    if len(data) < 24 or data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("the image is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def decode_image(payload: Any, *, shape: Any = None, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """The array :func:`encode_image` encoded. The payload is untrusted: it must be base64 of a
    PNG whose header gives at most ``max_pixels`` pixels and the expected shape (``shape``,
    else the payload's own), checked before anything is decoded; any other payload is a
    ``ValueError`` saying why."""
    from PIL import Image

    if not isinstance(payload, dict) or not isinstance(payload.get("png"), str):
        raise ValueError("an image must be an object {\"png\": base64, \"shape\": [H, W, 3]}")
    try:
        data = base64.b64decode(payload["png"], validate=True)
    except ValueError:  # binascii.Error
        raise ValueError("the image is not valid base64") from None
    width, height = png_size(data)
    if width * height > max_pixels or not (width and height):
        raise ValueError(f"the image is {width}x{height} pixels; at most {max_pixels} are decoded")
    expected = payload.get("shape") if shape is None else shape
    if expected is not None:
        if (not isinstance(expected, (list, tuple)) or len(expected) != 3
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in expected)):
            raise ValueError(f"an image's shape must be [H, W, 3], got {_clip(repr(expected))}")
        if list(expected) != [height, width, 3]:
            raise ValueError(f"the image is {height}x{width} by its header, expected {list(expected)}")
    try:
        with Image.open(io.BytesIO(data), formats=["PNG"]) as im:
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as exc:  # a damaged PNG: PIL raises OSError, SyntaxError, ValueError, EOFError, ...
        raise ValueError(f"the PNG cannot be decoded ({type(exc).__name__}: {_clip(str(exc))})") from None
    if arr.shape != (height, width, 3):
        raise ValueError(f"the image decodes to {arr.shape}, its header says {height}x{width}")
    return arr


def encode_observation(obs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"text": obs.get("text", "")}
    if obs.get("image") is not None:
        out["image"] = encode_image(obs["image"])
    return out


def decode_observation(payload: Any, *, shape: Any = None, max_pixels: int = MAX_IMAGE_PIXELS) -> dict[str, Any]:
    """An observation from its wire form; ``ValueError`` when it is malformed."""
    if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
        raise ValueError(f"an observation must be an object with a 'text' string, got {_clip(repr(payload))}")
    obs: dict[str, Any] = {"text": payload["text"]}
    if payload.get("image") is not None:
        obs["image"] = decode_image(payload["image"], shape=shape, max_pixels=max_pixels)
    return obs


def jsonable(value: Any) -> Any:
    """``value`` as plain JSON types: numpy scalars and arrays become numbers and lists, tuples
    lists, non-finite floats strings; anything else unknown its ``repr``."""
    kind = type(value)  # the plain types first, by identity (most of every answer)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is dict:
        return {k if type(k) is str else str(k): jsonable(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, np.generic):
        return jsonable(value.item())
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return repr(value)


# -- sessions -----------------------------------------------------------------------------------
class Session:
    """One env and when it was last used; its requests run one at a time."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self.closed = False


#: What clients may set: the task's declared kwargs (the default), any kwargs, or none.
CLIENT_KWARGS = ("declared", "any", "none")


def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + "..."


class TaskService:
    """The sessions of one task and what each request does to them (no HTTP here).

    ``client_kwargs``: ``"declared"`` (clients set what the task class declares, within its
    bounds), ``"any"`` (any kwarg but the task's ``server_kwargs``; declared ones still within
    bounds) or ``"none"``. ``allow_client_kwargs=True`` means ``"any"``, ``lock_kwargs=True``
    ``"none"``.
    """

    def __init__(self, env_id: str, kwargs: dict[str, Any] | None = None, limits: Limits | None = None, *,
                 client_kwargs: str = "declared", allow_client_kwargs: bool = False,
                 lock_kwargs: bool = False, inline: bool = True) -> None:
        import envs

        if client_kwargs not in CLIENT_KWARGS:
            raise ValueError(f"client_kwargs must be one of {CLIENT_KWARGS}, got {client_kwargs!r}")
        if allow_client_kwargs and lock_kwargs:
            raise ValueError("allow_client_kwargs and lock_kwargs contradict each other; choose one")
        self.spec = envs.task_spec(env_id)
        self.env_id = env_id
        self.client_kwargs = "any" if allow_client_kwargs else "none" if lock_kwargs else client_kwargs
        try:
            cls = envs.task_class(env_id)
        except TypeError:  # a factory function: nothing declared, so nothing a client may set
            cls = None
        self.allowed = dict(getattr(cls, "client_kwargs", None) or {})
        self.server_only = frozenset(getattr(cls, "server_kwargs", None) or ())
        self.kwargs = {**dict(getattr(cls, "served_kwargs", None) or {}), **dict(kwargs or {})}
        #: The operations answered on the event loop (the task's ``quick_calls``; none when
        #: ``inline`` is off, or once one of them took longer than :data:`INLINE_BUDGET`).
        self.quick = frozenset(getattr(cls, "quick_calls", None) or ()) & {"reset", "step", "call"} if inline \
            else frozenset()
        self.limits = limits or Limits()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.reaped = 0
        envs.make(env_id, **self.kwargs).close()  # a task that cannot be built fails before serving

    # sessions
    @property
    def open_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def info(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL, "task": self.env_id, "modality": self.spec.modality,
                "description": self.spec.description, "kwargs": jsonable(self.kwargs),
                "client_kwargs": self.client_kwargs,
                "allowed_kwargs": {} if self.client_kwargs == "none" else
                {k: {"kind": r.kind.__name__, "low": r.low, "high": r.high,
                     "choices": list(r.choices) if r.choices is not None else None,
                     **({"max_chars": r.max_chars} if r.kind is str else {})} for k, r in self.allowed.items()},
                "limits": asdict(self.limits)}

    def check_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The client's ``kwargs`` as the task gets them, or a :class:`ServeError`: a 403 for a
        kwarg the client may not set, a 400 for a value outside its bounds."""
        if not kwargs:
            return {}
        names = ", ".join(_clip(repr(k), 40) for k in sorted(kwargs)[:8])
        if self.client_kwargs == "none":
            raise ServeError(403, f"this server plays {self.env_id} with fixed kwargs; it was started with "
                                  f"--lock-kwargs, so {names} cannot be set")
        server_only = sorted(k for k in kwargs if k in self.server_only)
        if server_only:
            raise ServeError(403, f"{', '.join(server_only)} of {self.env_id} can be set only by the server "
                                  "(python -m envs.serve --kw), never by a client")
        refused = sorted(k for k in kwargs if k not in self.allowed)
        if refused and self.client_kwargs != "any":
            shown = ", ".join(_clip(repr(k), 40) for k in refused[:8])
            allowed = ", ".join(sorted(self.allowed)) or "nothing"
            raise ServeError(403, f"clients of this server cannot set {shown} for {self.env_id}: clients may set "
                                  f"{allowed} (the task's allow-list); the server's --allow-client-kwargs accepts "
                                  "others from trusted clients")
        out = {}
        for name, value in kwargs.items():
            rule = self.allowed.get(name)
            try:
                out[name] = rule.check(name, value) if rule is not None else value
            except ValueError as exc:
                raise ServeError(400, f"{self.env_id} cannot be built with these kwargs: {exc}") from None
        return out

    def open(self, body: dict[str, Any]) -> dict[str, Any]:
        import envs

        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ServeError(400, "'kwargs' must be a JSON object of task keyword arguments")
        kwargs = self.check_kwargs(kwargs)
        with self._lock:  # reserve the slot first, so concurrent opens cannot overshoot the limit
            if len(self._sessions) >= self.limits.max_sessions:
                raise ServeError(503, f"session limit reached ({len(self._sessions)} of {self.limits.max_sessions} "
                                      "open); close one (DELETE /sessions/<id>) or wait: idle sessions are closed "
                                      f"after {self.limits.idle_timeout:g} s")
            sid = uuid.uuid4().hex
            self._sessions[sid] = placeholder = Session(None)
            placeholder.lock.acquire()
        try:
            env = envs.make(self.env_id, **{**self.kwargs, **kwargs})
        except (TypeError, ValueError) as exc:
            self._drop(sid)
            raise ServeError(400, _clip(f"{self.env_id} cannot be built with kwargs {kwargs}: {exc}", 2000)) from None
        except Exception as exc:
            self._drop(sid)
            raise ServeError(500, _clip(f"{self.env_id} could not be built: {type(exc).__name__}: {exc}", 2000)) \
                from None
        placeholder.env = env
        placeholder.last_used = time.monotonic()
        placeholder.lock.release()
        inner = env.unwrapped
        image_space = getattr(env.observation_space, "spaces", {}).get("image")
        return {"session": sid, "task": self.env_id, "modality": self.spec.modality,
                "markov_state": bool(getattr(inner, "markov_state", False)),
                "image_shape": list(image_space.shape) if image_space is not None else None,
                "max_text_length": int(getattr(env.action_space, "max_length", 1 << 20)),
                "render_modes": list(getattr(inner, "metadata", {}).get("render_modes", ["ansi"])),
                "idle_timeout": self.limits.idle_timeout}

    def _drop(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def _session(self, sid: str) -> Session:
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            raise ServeError(404, f"no open session {_clip(repr(sid))}: it was closed, or reaped after "
                                  f"{self.limits.idle_timeout:g} s idle; open a new one (POST /sessions)")
        return session

    def close(self, sid: str) -> dict[str, Any]:
        with self._lock:
            session = self._sessions.pop(sid, None)
        if session is None:
            raise ServeError(404, f"no open session {_clip(repr(sid))}")
        self._close_env(session)
        return {"closed": sid}

    @staticmethod
    def _close_env(session: Session) -> None:
        with session.lock:
            session.closed = True
            if session.env is not None:
                try:
                    session.env.close()
                except Exception:  # closing must not fail the server
                    logger.exception("closing an env failed")

    def reap(self, now: float | None = None) -> int:
        """Close sessions idle longer than ``idle_timeout``; return how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale = [sid for sid, s in self._sessions.items()
                     if s.env is not None and not s.lock.locked() and now - s.last_used > self.limits.idle_timeout]
            victims = [self._sessions.pop(sid) for sid in stale]
        for session in victims:
            self._close_env(session)
        if victims:
            logger.info("closed %d idle session(s)", len(victims))
            self.reaped += len(victims)
        return len(victims)

    def close_all(self) -> None:
        with self._lock:
            victims = list(self._sessions.values())
            self._sessions.clear()
        for session in victims:
            self._close_env(session)

    # operations on one session
    def run(self, sid: str, op: str, body: dict[str, Any], *, blocking: bool = True) -> dict[str, Any]:
        """``op`` on session ``sid``; with ``blocking=False`` a :class:`Busy` instead of waiting
        while another request holds the session."""
        session = self._session(sid)
        if not session.lock.acquire(blocking):
            raise Busy()
        try:
            if session.closed:
                raise ServeError(404, f"session {_clip(repr(sid))} was closed")
            return getattr(self, "_" + op)(session.env, body)
        finally:
            session.last_used = time.monotonic()
            session.lock.release()

    @staticmethod
    def _reset(env: Any, body: dict[str, Any]) -> dict[str, Any]:
        seed, options = body.get("seed"), body.get("options")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63):
            raise ServeError(400, f"'seed' must be a non-negative integer below 2**63 or null, got {_clip(repr(seed))}")
        if options is not None and not isinstance(options, dict):
            raise ServeError(400, "'options' must be a JSON object or null")
        obs, info = env.reset(seed=seed, options=options)
        return {"observation": encode_observation(obs), "info": info}

    @staticmethod
    def _step(env: Any, body: dict[str, Any]) -> dict[str, Any]:
        if "action" not in body:
            raise ServeError(400, "'action' (the reply text) is required")
        action = body["action"]
        if not isinstance(action, str):
            raise ServeError(400, f"'action' must be a string, got {type(action).__name__}")
        try:
            obs, reward, terminated, truncated, info = env.step(action)
        except RuntimeError as exc:  # e.g. a step after the episode ended
            raise ServeError(409, _clip(str(exc), 500)) from None
        return {"observation": encode_observation(obs), "reward": float(reward), "terminated": bool(terminated),
                "truncated": bool(truncated), "info": info}

    @staticmethod
    def _call(env: Any, body: dict[str, Any]) -> dict[str, Any]:
        method, args = body.get("method"), body.get("args") or []
        if method not in CALLS:
            raise ServeError(400, f"'method' must be one of {', '.join(CALLS)}, got {_clip(repr(method))}")
        if not isinstance(args, list) or len(args) > 4:
            raise ServeError(400, "'args' must be a list of at most 4 JSON values")
        try:
            result = _answer(env.unwrapped, method, args)
        except NotImplementedError as exc:
            raise ServeError(501, str(exc) or f"{method} is not implemented by {type(env.unwrapped).__name__}") from None
        except (TypeError, ValueError) as exc:
            raise ServeError(400, _clip(f"{method}: {exc}", 300)) from None
        if method == "render_image":
            return {"result": encode_image(result)}
        return {"result": result}

    def batch(self, body: dict[str, Any], *, blocking: bool = True, done: list | None = None) -> dict[str, Any]:
        """The answers of a ``/batch`` body's calls, in order. ``done``: the answers of its first
        calls, already made (the rest are made now); with ``blocking=False`` a session another
        request holds stops the batch with a :class:`Busy` holding the answers so far."""
        calls = body.get("calls")
        if not isinstance(calls, list):
            raise ServeError(400, "'calls' must be a list of {session, op, ...} objects")
        if len(calls) > self.limits.max_sessions:
            raise ServeError(400, f"a batch holds at most {self.limits.max_sessions} calls (max_sessions), got {len(calls)}")
        results = [] if done is None else done
        for call in calls[len(results):]:
            try:
                if not isinstance(call, dict) or call.get("op") not in ("reset", "step", "call"):
                    raise ServeError(400, "each call must be an object with 'session' and 'op' (reset, step or call)")
                results.append(self.run(str(call.get("session")), call["op"], call, blocking=blocking))
            except Busy as busy:
                busy.done = results
                raise
            except ServeError as err:
                results.append({"error": str(err), "status": err.status})
            except Exception as err:
                logger.exception("batch call failed")
                results.append({"error": _clip(f"{type(err).__name__}: {err}", 500), "status": 500})
        return {"results": results}


# -- HTTP ------------------------------------------------------------------------------------------
def _parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 saying why not."""
    if not raw:
        return {}
    try:
        body = parse_json(raw)
    except ValueError as err:
        raise ServeError(400, _clip(str(err), 300)) from None
    if not isinstance(body, dict):
        raise ServeError(400, "the body must be a JSON object")
    return body


def _plain(value: Any) -> Any:
    """What JSON cannot write itself, as :func:`jsonable` writes it (numpy values, other objects)."""
    return jsonable(value.tolist() if isinstance(value, np.ndarray) else
                    value.item() if isinstance(value, np.generic) else value)


def _encode(payload: dict[str, Any]) -> bytes:
    """An answer as UTF-8 JSON, its values as :func:`jsonable` makes them: written directly when
    it holds plain values (the common case, without copying it first), through :func:`jsonable`
    when it holds a non-finite float or a key JSON cannot write."""
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False, default=_plain).encode("utf-8")
    except (ValueError, TypeError):
        return json.dumps(jsonable(payload), ensure_ascii=False).encode("utf-8")


#: Bodies of at most this many bytes may be answered on the event loop (larger ones are read
#: there, decoded in the pool).
INLINE_BYTES = 64 << 10
#: Seconds an answer on the event loop may take: past it the task's calls go to the pool for good.
INLINE_BUDGET = 0.05


class _Later:
    """A request the event loop began and the pool finishes: its decoded body and, for a
    batch, the answers made so far."""

    __slots__ = ("body", "done")

    def __init__(self, body: dict[str, Any], done: list | None = None) -> None:
        self.body, self.done = body, done


class TaskApp:
    """The ASGI app of one :class:`TaskService`. A request's body is read on the event loop
    (the connection's deadline and the size cap hold while it arrives). Decoding it, the task's
    work and encoding the answer run in a pool of threads, so a slow step (an answer scored in
    the task's worker process, a level generated) never holds up another request; except for
    the calls a task declares quick (its ``quick_calls``: a FrozenLake step, a board's text),
    which with a body of at most :data:`INLINE_BYTES` are answered on the event loop itself,
    saving the two thread hand-offs that cost more than the step. Such a call that meets a
    session held by another request goes to the pool, and one that takes longer than
    :data:`INLINE_BUDGET` sends every later call there."""

    def __init__(self, service: TaskService) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.service = service
        limits = service.limits
        self.pool = ThreadPoolExecutor(max_workers=max(4, min(limits.max_sessions, limits.max_connections)) + 2,
                                       thread_name_prefix="envs.serve")
        self.stopping = False
        self.inline_answers = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        close = False
        try:
            if self.stopping:
                raise Refused(503, "the server is shutting down", close=True)
            raw = b""
            if method in ("POST", "DELETE"):
                limit = self.service.limits.max_message_bytes
                raw = await read_body(scope, receive, limit, drain=4 * limit, optional=method == "DELETE")
                if raw is None:  # the client left, or its request did not arrive in time (answered 408)
                    return
            if method == "GET" and path == "/health":
                status, data = 200, _encode({"status": "ok", "task": self.service.env_id,
                                             "sessions": self.service.open_sessions,
                                             "max_sessions": self.service.limits.max_sessions})
            else:
                quick = self.quick_answer(method, path, raw) if self.service.quick else None
                if isinstance(quick, tuple):
                    status, data = quick
                else:
                    body, done = (quick.body, quick.done) if quick is not None else (None, None)
                    loop = asyncio.get_running_loop()
                    status, data = await loop.run_in_executor(self.pool, self.answer, method, path, raw, body, done)
        except Refused as err:
            message = str(err) + (" (--max-message-bytes)" if err.status == 413 else "")
            status, data, close = err.status, _encode({"error": message}), err.close
        await send_json(send, status, data, close=close)

    def quick_answer(self, method: str, path: str, raw: bytes) -> tuple[int, bytes] | _Later | None:
        """The answer to a quick call, made here on the event loop; else ``None`` (the pool
        answers the request) or where the pool takes it up (:class:`_Later`)."""
        service = self.service
        if method != "POST" or len(raw) > INLINE_BYTES:
            return None
        parts = [p for p in path.split("/") if p]
        batch = parts == ["batch"]
        if not batch and not (len(parts) == 3 and parts[0] == "sessions" and parts[2] in service.quick):
            return None
        start = time.perf_counter()
        try:
            body = _parse_body(raw)
        except ServeError:
            body = None  # answered below: answer() decodes it again and says why
        if batch and body is not None:
            calls = body.get("calls")
            if isinstance(calls, list) and not all(type(c) is dict and type(c.get("op")) is str
                                                   and c["op"] in service.quick for c in calls):
                return _Later(body)
        try:
            answer = self.answer(method, path, raw, body, blocking=False)
        except Busy as busy:  # another request holds a session: the pool waits for it
            return _Later(body, busy.done)
        self.inline_answers += 1
        took = time.perf_counter() - start
        if took > INLINE_BUDGET and service.quick:
            service.quick = frozenset()
            logger.warning("a quick call of %s took %.0f ms on the event loop (over %.0f ms); its calls are "
                           "answered in the pool from now on", service.env_id, took * 1e3, INLINE_BUDGET * 1e3)
        return answer

    def answer(self, method: str, path: str, raw: bytes, body: dict[str, Any] | None = None,
               done: list | None = None, *, blocking: bool = True) -> tuple[int, bytes]:
        """``(status, JSON answer)`` of one request whose body has arrived (in a pool thread, or
        on the event loop with ``blocking=False``: a :class:`Busy` then, instead of waiting for a
        session another request holds); ``body``: already decoded; ``done``: a batch's answers
        so far."""
        service = self.service
        try:
            if body is None:
                body = _parse_body(raw)
            parts = [p for p in path.split("/") if p]
            if method == "GET" and parts == ["info"]:
                out = service.info()
            elif method == "POST" and parts == ["sessions"]:
                out = service.open(body)
            elif method == "POST" and parts == ["batch"]:
                out = service.batch(body, blocking=blocking, done=done)
            elif method == "POST" and len(parts) == 3 and parts[0] == "sessions" and parts[2] in ("reset", "step", "call"):
                out = service.run(parts[1], parts[2], body, blocking=blocking)
            elif method == "DELETE" and len(parts) == 2 and parts[0] == "sessions":
                out = service.close(parts[1])
            else:
                raise ServeError(404, f"unknown endpoint {_clip(method, 10)} {_clip(repr(path))}; see "
                                      "`python -m envs.serve --help`")
            return 200, _encode(out)
        except Busy:
            raise
        except ServeError as err:
            return err.status, _encode({"error": str(err)})
        except Exception as err:  # a task's bug must not kill the server; the client sees a 500
            logger.exception("request failed")
            return 500, _encode({"error": _clip(f"internal error: {type(err).__name__}: {err}", 500)})


class TaskServer(HTTPServer):
    """The task server: :class:`TaskApp` on the shared uvicorn lifecycle (:mod:`envs.asgi`), with a
    reaper thread closing idle sessions."""

    def __init__(self, address: tuple[str, int], service: TaskService) -> None:
        self.service = service
        self.app = TaskApp(service)
        limits = service.limits
        super().__init__(self.app, address[0], address[1], on_close=self._close_sessions,
                         limits=HTTPLimits(request_timeout=limits.request_timeout,
                                           max_connections=limits.max_connections))
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="envs.serve-reaper", daemon=True)
        self._reaper.start()

    def _reap_loop(self) -> None:
        period = min(5.0, max(0.05, self.service.limits.idle_timeout / 4))
        while not self._stop.wait(period):
            try:
                self.service.reap()
            except Exception:
                logger.exception("reaping idle sessions failed")

    def shutdown(self, timeout: float | None = None) -> None:
        self.app.stopping = True  # requests on open connections are answered 503 from now on
        super().shutdown(timeout)

    def _close_sessions(self) -> None:
        self.app.stopping = True
        self._stop.set()
        self.app.pool.shutdown(wait=False, cancel_futures=True)
        self.service.close_all()


def make_server(env_id: str, host: str = "127.0.0.1", port: int = 0, *, kwargs: dict[str, Any] | None = None,
                limits: Limits | None = None, client_kwargs: str = "declared", allow_client_kwargs: bool = False,
                lock_kwargs: bool = False, inline: bool = True) -> TaskServer:
    """A server for ``env_id`` bound to ``host:port`` (0: a free port), not yet serving:
    ``start()`` (in a thread of its own) or ``serve_forever()``, then ``shutdown()`` and
    ``server_close()`` (:class:`envs.asgi.HTTPServer`). ``client_kwargs``,
    ``allow_client_kwargs``, ``lock_kwargs``, ``inline``: :class:`TaskService`'s."""
    return TaskServer((host, port), TaskService(env_id, kwargs, limits, client_kwargs=client_kwargs,
                                                allow_client_kwargs=allow_client_kwargs, lock_kwargs=lock_kwargs,
                                                inline=inline))


def serve(env_id: str, host: str, port: int, *, kwargs: dict[str, Any] | None = None, limits: Limits | None = None,
          client_kwargs: str = "declared", allow_client_kwargs: bool = False, lock_kwargs: bool = False,
          inline: bool = True) -> None:
    """Serve until SIGTERM/SIGINT, then close every session and exit."""
    server = make_server(env_id, host, port, kwargs=kwargs, limits=limits, client_kwargs=client_kwargs,
                         allow_client_kwargs=allow_client_kwargs, lock_kwargs=lock_kwargs, inline=inline)
    vision = "Vision" if server.service.spec.modality == "vision" else ""
    serve_until_signal(server, f"serving {env_id} ({PROTOCOL}) at {server.url}: "
                               f"gym.make('freshper/Remote{vision}-v0', url='{server.url}')")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("env_id", help="a registered task id (python -m envs list)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--max-sessions", type=int, default=Limits.max_sessions, help="open sessions at most")
    parser.add_argument("--idle-timeout", type=float, default=Limits.idle_timeout,
                        help="seconds without a request after which a session is closed")
    parser.add_argument("--max-message-bytes", type=int, default=Limits.max_message_bytes,
                        help="largest request body accepted")
    parser.add_argument("--request-timeout", type=float, default=Limits.request_timeout,
                        help="seconds a request may take to arrive, headers and body together (408 past them)")
    parser.add_argument("--max-connections", type=int, default=Limits.max_connections,
                        help="open connections at most; the longest-idle one is closed for a new "
                             "one, or the new one answered 503 when every one is busy")
    parser.add_argument("--kw", nargs="*", default=[], metavar="KEY=VALUE", help="task keyword arguments")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--allow-client-kwargs", action="store_true",
                     help="let clients set task kwargs beyond the task's allow-list (trusted clients only; the "
                          "allow-list's bounds and the server-only kwargs still hold)")
    who.add_argument("--lock-kwargs", action="store_true",
                     help="refuse every task kwarg from clients, the task's allow-list included")
    parser.add_argument("--no-inline", dest="inline", action="store_false",
                        help="answer every call in the thread pool, the task's quick calls too")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from envs.play import parse_kwargs

    try:
        limits = Limits(args.max_sessions, args.idle_timeout, args.max_message_bytes, args.request_timeout,
                        args.max_connections)
    except ValueError as exc:
        parser.error(str(exc))
    kwargs = parse_kwargs(args.kw)
    serve(args.env_id, args.host, args.port, kwargs=kwargs, limits=limits,
          allow_client_kwargs=args.allow_client_kwargs, lock_kwargs=args.lock_kwargs, inline=args.inline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
