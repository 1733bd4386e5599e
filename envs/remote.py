"""A task served by ``python -m envs.serve``, played through a ``gymnasium.Env`` client.

    gym.make("freshper/Remote-v0", url="http://127.0.0.1:8000")                  # a text task
    gym.make("freshper/RemoteVision-v0", url="http://host:8000", size=6)        # a vision task, with task kwargs
    python train.py --env-id freshper/Remote-v0 --env-kwargs '{"url": "http://127.0.0.1:8000", "feedback": false}'

Each env opens one session on the server (one served env), closed by ``close()``. Keyword
arguments other than the client's own (``url``, ``client_timeout``, ``client_retries``,
``render_mode``) are the served task's: they update the server's defaults where the task lets
clients set them (its ``client_kwargs``, within their bounds; a server started with
``--allow-client-kwargs`` takes others too, one with ``--lock-kwargs`` none). ``url`` defaults
to the ``FRESHPER_ENV_URL`` environment variable.

What a trainer needs of a task works remotely: observations (images decoded from lossless PNG),
rewards and ``info``, and the task contract's text methods (``legal_actions``,
``format_reply``, ``render_text``, ``lookahead_text``, ...; :data:`envs.serve.CALLS`), so a
served task can be pretrained on too; ``sample_reply(rng)`` draws locally from the served
``effective_actions`` exactly as the task would. Runners that step a turn's envs together
(:func:`MultiTurnEnv.before_batch_step`) send the whole turn to each server as one ``/batch``
request, and resets announced together (:func:`MultiTurnEnv.before_batch_reset`) go as one
too. Each env keeps one keep-alive connection (:class:`envs.wire.KeepAlive`). The optional text
capabilities (:mod:`envs.capabilities`) are answered by the served task, a missing one with
:class:`envs.capabilities.MissingCapability` (a ``NotImplementedError``) on the call (the
client cannot know beforehand).
Not available remotely: ``counterfactual_probes`` and ``turn_diagnostics`` (the defaults: none).

Faults: the server is retried while it cannot be reached (``client_retries`` times, with
backoff) and a full server (503) is waited for likewise. A step that then still fails
(connection lost, a timeout, the session reaped, a malformed answer) ends the episode with
``info["failed"] = True`` and ``info["error"]``: trainers count it as an infrastructure fault,
not a policy failure. A reset that fails raises :class:`RemoteEnvError`; a session the server
reaped is reopened at the next reset.

Every answer is untrusted: each request, its whole answer included, ends within
``client_timeout`` however the server paces it; the body is decoded as it arrives (chunked,
gzip or deflate) and refused once it passes ``max_response_bytes``; its JSON may nest at most
64 deep; every field is checked for its type (a finite ``reward``, boolean flags, an object
``info``, a text observation); an image must be base64 of a PNG whose header gives the
session's shape and at most 16 megapixels, checked before it is decoded.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any, ClassVar, Sequence

import gymnasium as gym
import numpy as np

from envs.adapters.external import failed_info
from envs.capabilities import MissingCapability
from envs.serve import MAX_IMAGE_PIXELS, PROTOCOL, decode_image, decode_observation
from envs.spaces import AnyText
from envs.wire import AnswerError, Broken, KeepAlive, TooLate, Unreachable, clip, loads_json

URL_ENV_VAR = "FRESHPER_ENV_URL"
#: What a session id may look like (it goes into the request path).
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class RemoteEnvError(ConnectionError):
    """The task server refused a request or could not be reached; the message says which."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RemoteEnv(gym.Env):
    """A text task on a ``python -m envs.serve`` server (``freshper/Remote-v0``)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 4}
    modality: ClassVar[str] = "text"
    markov_state: bool = False

    def __init__(self, url: str | None = None, *, client_timeout: float = 60.0, client_retries: int = 4,
                 max_response_bytes: int = 64 << 20, render_mode: str | None = None, **task_kwargs: Any) -> None:
        url = url or os.environ.get(URL_ENV_VAR)
        if not url:
            raise ValueError(f"{type(self).__name__} needs the server's url: url='http://host:port' "
                             f"(a `python -m envs.serve TASK` server) or the {URL_ENV_VAR} environment variable")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']} or None, got {render_mode!r}")
        self.url = url.rstrip("/")
        self.render_mode = render_mode
        self.retries = int(client_retries)
        self.max_response_bytes = int(max_response_bytes)
        if not (client_timeout > 0 and math.isfinite(client_timeout)) or self.retries < 0 or self.max_response_bytes < 1024:
            raise ValueError("client_timeout must be a positive number of seconds, client_retries >= 0 and "
                             "max_response_bytes >= 1024")
        self.timeout = float(client_timeout)
        self.task_kwargs = dict(task_kwargs)
        self.image_shape: tuple[int, ...] | None = None
        self._conn = KeepAlive(self.url, connect_timeout=min(10.0, self.timeout))
        self._session: str | None = None
        self._obs: dict[str, Any] | None = None
        self._pending: tuple[str, dict[str, Any]] | None = None  # (reply, answer) from a batched turn
        self._pending_reset: tuple[int | None, Any] | None = None  # (seed, answer) from a batched reset
        self._closed = False
        self._open()

    # -- transport ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                 retry_sent: bool = False) -> dict[str, Any]:
        """One request; retried with backoff while the server cannot be reached or is full (503),
        and, when ``retry_sent``, after a timeout or a dropped connection too (only for requests
        safe to repeat). Each attempt, its whole answer included, ends within ``client_timeout``;
        the answer is decoded as it arrives and refused past ``max_response_bytes``; it must be
        a JSON object. Anything else is a :class:`RemoteEnvError` saying why."""
        delay = 0.2
        where = f"{method} {self.url}{path}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        for attempt in range(self.retries + 1):
            try:
                status, raw = self._conn.request(method, path, data, timeout=self.timeout, cap=self.max_response_bytes)
            except AnswerError as exc:
                raise RemoteEnvError(f"{where}: {exc} (max_response_bytes={self.max_response_bytes})") from None
            except Unreachable as exc:
                if attempt == self.retries:
                    raise RemoteEnvError(f"cannot reach the task server at {self.url} ({clip(str(exc))}); is "
                                         "`python -m envs.serve` running there?") from None
                time.sleep(delay)
                delay *= 2
                continue
            except TooLate:
                if not retry_sent or attempt == self.retries:
                    raise RemoteEnvError(f"{where}: no complete answer within client_timeout={self.timeout:g} s") \
                        from None
                time.sleep(delay)
                delay *= 2
                continue
            except Broken as exc:  # dropped, reset or garbled mid-answer
                if not retry_sent or attempt == self.retries:
                    raise RemoteEnvError(f"{where}: the connection failed ({clip(str(exc))})") from None
                time.sleep(delay)
                delay *= 2
                continue
            try:
                payload = loads_json(raw, what="the answer")
            except AnswerError as exc:
                raise RemoteEnvError(f"{where}: the server answered {status}; {exc}", status) from None
            if not isinstance(payload, dict):
                raise RemoteEnvError(f"{where}: the server answered {status} with {clip(payload)}, not a JSON object",
                                     status)
            if status == 503 and attempt < self.retries:
                time.sleep(delay)
                delay *= 2
                continue
            if status != 200:
                error = payload.get("error")
                raise RemoteEnvError(f"{where}: {status} {clip(error if isinstance(error, str) else payload, 2000)}",
                                     status)
            return payload
        raise AssertionError("unreachable")

    def _open(self) -> None:
        info = self._request("POST", "/sessions", {"kwargs": self.task_kwargs}, retry_sent=True)
        session = info.get("session")
        if not isinstance(session, str) or not _SESSION_ID.fullmatch(session):
            raise RemoteEnvError(f"{self.url} opened a session without a usable id: {clip(session)}")
        if info.get("modality") != self.modality:
            self._request("DELETE", f"/sessions/{session}")
            other = "freshper/RemoteVision-v0" if info.get("modality") == "vision" else "freshper/Remote-v0"
            raise ValueError(f"{self.url} serves {clip(info.get('task'), 100)}, a {clip(info.get('modality'), 20)} "
                             f"task: play it as {other}")
        shape = info.get("image_shape")
        if shape is not None and not (isinstance(shape, list) and len(shape) == 3 and shape[2] == 3
                                      and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
                                      and shape[0] * shape[1] <= MAX_IMAGE_PIXELS):
            raise RemoteEnvError(f"{self.url}: the session's image_shape must be [H, W, 3] of at most "
                                 f"{MAX_IMAGE_PIXELS} pixels, got {clip(shape)}")
        max_text = info.get("max_text_length", 1 << 20)
        if isinstance(max_text, bool) or not isinstance(max_text, int) or not 1 <= max_text <= 1 << 30:
            raise RemoteEnvError(f"{self.url}: the session's max_text_length must be a positive integer, got "
                                 f"{clip(max_text)}")
        self._session = session
        self.served_task = clip(str(info.get("task")), 200)
        self.markov_state = info.get("markov_state") is True
        self._skips_noop = None
        spaces: dict[str, gym.Space] = {"text": AnyText(max_length=1 << 22)}
        self.image_shape = tuple(shape) if shape else None
        if shape:
            spaces["image"] = gym.spaces.Box(0, 255, self.image_shape, dtype=np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = AnyText(max_length=max_text)

    def _observation(self, payload: Any) -> dict[str, Any]:
        """An observation the server sent, checked (``ValueError`` saying why): its text, and
        for a vision task an image of the session's shape, checked from its header before decoding."""
        obs = decode_observation(payload, shape=self.image_shape, max_pixels=MAX_IMAGE_PIXELS)
        if self.image_shape is not None and "image" not in obs:
            raise ValueError("the observation has no image; this session's observations hold one")
        if self.image_shape is None:
            obs.pop("image", None)
        return obs

    def _session_path(self, op: str) -> str:
        if self._closed:
            raise RemoteEnvError("this remote env is closed")
        return f"/sessions/{self._session}/{op}"

    def _call(self, method: str, *args: Any, kind: type = object) -> Any:
        """The served task's answer to ``method``, checked to be a ``kind``; :class:`RemoteEnvError`
        otherwise."""
        try:
            answer = self._request("POST", self._session_path("call"), {"method": method, "args": list(args)},
                                   retry_sent=True)
        except RemoteEnvError as exc:
            if exc.status == 501:  # the served task lacks this capability
                raise MissingCapability(str(exc)) from None
            raise
        if "result" not in answer:
            raise RemoteEnvError(f"{self.url}: the answer to {method} has no 'result'")
        result = answer["result"]
        if not isinstance(result, kind):
            raise RemoteEnvError(f"{self.url}: the answer to {method} must be a {getattr(kind, '__name__', kind)}, "
                                 f"got {clip(result)}")
        return result

    # -- gymnasium ------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self._pending = None
        pending, self._pending_reset = self._pending_reset, None
        body = {"seed": seed, "options": options}
        if pending is not None and pending[0] == seed and options is None and isinstance(pending[1], dict) \
                and "error" not in pending[1]:
            answer = pending[1]  # answered by the batch (an error there: asked again below)
        else:
            try:
                answer = self._request("POST", self._session_path("reset"), body, retry_sent=True)
            except RemoteEnvError as exc:
                if exc.status != 404:
                    raise
                self._open()  # reaped while idle: a fresh session, then the same reset
                answer = self._request("POST", self._session_path("reset"), body, retry_sent=True)
        try:
            obs = self._observation(answer.get("observation"))
            info = answer.get("info", {})
            if not isinstance(info, dict):
                raise ValueError(f"'info' must be an object, got {clip(info)}")
        except ValueError as exc:
            raise RemoteEnvError(f"{self.url}: a malformed reset answer: {exc}") from None
        self._obs = obs
        return self._obs, info

    def _failed_step(self, error: str) -> tuple[dict, float, bool, bool, dict]:
        obs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in (self._obs or {"text": ""}).items()}
        return obs, 0.0, True, False, failed_info(error)

    def _finish(self, answer: Any) -> tuple[dict, float, bool, bool, dict]:
        """A step's answer, every field checked; a malformed one is a failed step saying why."""
        try:
            if not isinstance(answer, dict):
                raise ValueError(f"the answer is {clip(answer)}, not a JSON object")
            obs = self._observation(answer.get("observation"))
            reward = answer.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ValueError(f"'reward' must be a finite number, got {clip(reward)}")
            flags = answer.get("terminated"), answer.get("truncated")
            if not all(isinstance(f, bool) for f in flags):
                raise ValueError(f"'terminated' and 'truncated' must be true or false, got {clip(flags)}")
            info = answer.get("info", {})
            if not isinstance(info, dict):
                raise ValueError(f"'info' must be an object, got {clip(info)}")
        except ValueError as exc:
            return self._failed_step(f"{self.url}: a malformed step answer: {exc}")
        self._obs = obs
        return obs, float(reward), flags[0], flags[1], info

    def step(self, action: str) -> tuple[dict, float, bool, bool, dict]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == action:
            answer = pending[1]
            if isinstance(answer, dict) and "error" in answer:
                error = clip(answer["error"] if isinstance(answer["error"], str) else answer, 2000)
                if answer.get("status") == 409:
                    raise RuntimeError(error)
                return self._failed_step(f"{self.url}: {error}")
            return self._finish(answer)
        action = action if isinstance(action, str) else ""
        try:
            answer = self._request("POST", self._session_path("step"), {"action": action})
        except RemoteEnvError as exc:
            if exc.status == 409:  # a step after the episode ended: the same error as a local task
                raise RuntimeError(str(exc).split(": 409 ", 1)[-1]) from None
            if exc.status in (400, 413):  # the request itself was refused: the caller's to fix
                raise
            return self._failed_step(str(exc))
        return self._finish(answer)

    @classmethod
    def before_batch_step(cls, envs: Sequence["RemoteEnv"], replies: Sequence[str]) -> None:
        """Send a turn's steps to each server as one ``/batch`` request; each env's ``step``
        then returns its answer (a step with another reply asks the server itself)."""
        answers = cls._batch(envs, [reply if isinstance(reply, str) else "" for reply in replies], "step", "action")
        for env, reply, answer in answers:
            env._pending = (reply, answer)

    @classmethod
    def before_batch_reset(cls, envs: Sequence["RemoteEnv"], seeds: Sequence[int | None]) -> None:
        """Send the resets of many envs to each server as one ``/batch`` request; each env's
        ``reset(seed=...)`` then returns its answer (another seed, options, or an error in the
        batch: it asks the server itself)."""
        seeds = [None if seed is None else int(seed) for seed in seeds]
        for env, seed, answer in cls._batch(envs, seeds, "reset", "seed"):
            env._pending_reset = (seed, answer)

    @staticmethod
    def _batch(envs: Sequence["RemoteEnv"], values: list[Any], op: str, key: str) -> list[tuple["RemoteEnv", Any, Any]]:
        """``(env, value, answer)`` of one ``/batch`` request of ``op`` per server with at least
        two of these envs; envs of a server whose batch failed are left out (each asks alone)."""
        by_url: dict[str, list[tuple[RemoteEnv, Any]]] = {}
        for env, value in zip(envs, values):
            if not env._closed and env._session is not None:
                by_url.setdefault(env.url, []).append((env, value))
        out = []
        for members in by_url.values():
            if len(members) < 2:
                continue
            calls = [{"session": env._session, "op": op, key: value} for env, value in members]
            try:
                results = members[0][0]._request("POST", "/batch", {"calls": calls}).get("results")
            except RemoteEnvError:
                continue  # each env asks on its own, and reports its own fault
            if not isinstance(results, list) or len(results) != len(members):
                continue  # a malformed batch answer: each env asks on its own
            out.extend((env, value, answer) for (env, value), answer in zip(members, results))
        return out

    def render(self) -> str | np.ndarray | None:
        if self.render_mode == "ansi":
            return self.render_text()
        if self.render_mode == "rgb_array":
            return self.render_image()
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._session is not None:
                self._conn.request("DELETE", f"/sessions/{self._session}", timeout=5.0, cap=1 << 16)
        except (OSError, AnswerError):
            pass  # the server reaps it when idle
        finally:
            self._conn.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    # -- the task contract, answered by the served task ----------------------------------------
    def instructions(self) -> str:
        return self._call("instructions", kind=str)

    def state_text(self) -> str:
        return self._call("state_text", kind=str)

    def render_text(self) -> str:
        return self._call("render_text", kind=str)

    def legal_actions(self) -> list[str]:
        return self._call("legal_actions", kind=list)

    def effective_actions(self) -> list[str]:
        return self._call("effective_actions", kind=list)

    def skips_noop_moves(self) -> bool:
        if self._skips_noop is None:
            self._skips_noop = self._call("skips_noop_moves", kind=bool)
        return self._skips_noop

    def format_reply(self, action: Any) -> str:
        return self._call("format_reply", action, kind=str)

    def sample_reply(self, rng: np.random.Generator) -> str:
        """A uniformly drawn effective action in the task's reply format: the same draw from
        ``rng`` as :meth:`envs.MultiTurnEnv.sample_reply` makes in-process."""
        legal = self.effective_actions()
        if not legal:
            raise ValueError(f"{self.served_task}: effective_actions() is empty in this state")
        return self.format_reply(legal[int(rng.integers(len(legal)))])

    def describe_action(self, reply: str) -> str:
        return self._call("describe_action", reply, kind=str)

    def outcome_text(self, terminated: bool, success: bool) -> str:
        return self._call("outcome_text", bool(terminated), bool(success), kind=str)

    def lookahead_text(self) -> str:
        return self._call("lookahead_text", kind=str)

    def aim_text(self) -> str:
        return self._call("aim_text", kind=str)

    def subgoal_text(self) -> str:
        return self._call("subgoal_text", kind=str)

    def subgoal_moves(self) -> list[str]:
        return self._call("subgoal_moves", kind=list)

    def tokenizer_text(self) -> str:
        return self._call("tokenizer_text", kind=str)

    def render_image(self) -> np.ndarray:
        try:
            return decode_image(self._call("render_image", kind=dict), max_pixels=MAX_IMAGE_PIXELS)
        except ValueError as exc:
            raise RemoteEnvError(f"{self.url}: a malformed render_image answer: {exc}") from None


class RemoteVisionEnv(RemoteEnv):
    """A vision task on a ``python -m envs.serve`` server (``freshper/RemoteVision-v0``)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}
    modality: ClassVar[str] = "vision"


def server_info(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """``GET /info`` of a task server: its task id, modality, kwargs and limits (the answer
    read within ``timeout`` and 1 MB; :class:`RemoteEnvError` otherwise)."""
    where = url.rstrip("/") + "/info"
    conn = KeepAlive(url.rstrip("/"), connect_timeout=timeout)
    try:
        status, raw = conn.request("GET", "/info", timeout=timeout, cap=1 << 20)
        info = loads_json(raw, what="the answer")
    except (OSError, AnswerError) as exc:
        raise RemoteEnvError(f"GET {where}: {type(exc).__name__}: {clip(str(exc))}") from None
    finally:
        conn.close()
    if status != 200 or not isinstance(info, dict):
        raise RemoteEnvError(f"GET {where}: {status} {clip(info)}", status)
    if info.get("protocol") != PROTOCOL:
        raise RemoteEnvError(f"{url} speaks {clip(info.get('protocol'), 60)}, not {PROTOCOL!r}")
    return info


def remote_id(url: str) -> str:
    """The id to play the task served at ``url`` with: ``freshper/Remote-v0`` or
    ``freshper/RemoteVision-v0``, by the served task's modality."""
    return "freshper/RemoteVision-v0" if server_info(url)["modality"] == "vision" else "freshper/Remote-v0"
