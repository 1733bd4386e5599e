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
request. The optional text capabilities (:mod:`envs.capabilities`) are answered by the served
task, a missing one with ``NotImplementedError`` on the call (the client cannot know beforehand).
Not available remotely: ``counterfactual_probes`` and ``turn_diagnostics`` (the defaults: none).

Faults: the server is retried while it cannot be reached (``client_retries`` times, with
backoff) and a full server (503) is waited for likewise. A step that then still fails
(connection lost, a timeout, the session reaped) ends the episode with ``info["failed"] =
True`` and ``info["error"]``: trainers count it as an infrastructure fault, not a policy
failure. A reset that fails raises :class:`RemoteEnvError`; a session the server reaped is
reopened at the next reset.
"""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar, Sequence

import gymnasium as gym
import httpx
import numpy as np

from envs.serve import PROTOCOL, decode_image, decode_observation
from envs.spaces import AnyText

URL_ENV_VAR = "FRESHPER_ENV_URL"


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
        self.task_kwargs = dict(task_kwargs)
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(client_timeout, connect=10.0))
        self._session: str | None = None
        self._obs: dict[str, Any] | None = None
        self._pending: tuple[str, dict[str, Any]] | None = None  # (reply, answer) from a batched turn
        self._closed = False
        self._open()

    # -- transport ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                 retry_sent: bool = False) -> dict[str, Any]:
        """One request; retried with backoff while the server cannot be reached or is full (503),
        and, when ``retry_sent``, after a timeout too (only for requests safe to repeat)."""
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                with self._client.stream(method, path, json=body) as resp:
                    size = int(resp.headers.get("content-length") or 0)
                    if size > self.max_response_bytes:
                        raise RemoteEnvError(f"{method} {self.url}{path}: the answer is {size} bytes, above "
                                             f"max_response_bytes={self.max_response_bytes}")
                    raw = resp.read()
                status = resp.status_code
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                if attempt == self.retries:
                    raise RemoteEnvError(f"cannot reach the task server at {self.url} ({type(exc).__name__}: {exc}); "
                                         "is `python -m envs.serve` running there?") from exc
                time.sleep(delay)
                delay *= 2
                continue
            except httpx.TimeoutException as exc:
                if not retry_sent or attempt == self.retries:
                    raise RemoteEnvError(f"{method} {self.url}{path} timed out ({type(exc).__name__})") from exc
                time.sleep(delay)
                delay *= 2
                continue
            try:
                payload = httpx.Response(status, content=raw).json()
            except ValueError:
                raise RemoteEnvError(f"{method} {self.url}{path}: the server answered {status} with "
                                     f"non-JSON {raw[:200]!r}", status) from None
            if status == 503 and attempt < self.retries:
                time.sleep(delay)
                delay *= 2
                continue
            if status != 200:
                raise RemoteEnvError(f"{method} {self.url}{path}: {status} {payload.get('error', payload)}", status)
            return payload
        raise AssertionError("unreachable")

    def _open(self) -> None:
        info = self._request("POST", "/sessions", {"kwargs": self.task_kwargs}, retry_sent=True)
        if info.get("modality") != self.modality:
            self._request("DELETE", f"/sessions/{info['session']}")
            other = "freshper/RemoteVision-v0" if info.get("modality") == "vision" else "freshper/Remote-v0"
            raise ValueError(f"{self.url} serves {info.get('task')}, a {info.get('modality')} task: play it "
                             f"as {other}")
        self._session = info["session"]
        self.served_task = str(info.get("task"))
        self.markov_state = bool(info.get("markov_state", False))
        self._skips_noop = None
        spaces: dict[str, gym.Space] = {"text": AnyText(max_length=1 << 22)}
        if info.get("image_shape"):
            self.image_shape = tuple(info["image_shape"])
            spaces["image"] = gym.spaces.Box(0, 255, self.image_shape, dtype=np.uint8)
        self.observation_space = gym.spaces.Dict(spaces)
        self.action_space = AnyText(max_length=int(info.get("max_text_length", 1 << 20)))

    def _session_path(self, op: str) -> str:
        if self._closed:
            raise RemoteEnvError("this remote env is closed")
        return f"/sessions/{self._session}/{op}"

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return self._request("POST", self._session_path("call"), {"method": method, "args": list(args)},
                                 retry_sent=True)["result"]
        except RemoteEnvError as exc:
            if exc.status == 501:
                raise NotImplementedError(str(exc)) from None
            raise

    # -- gymnasium ------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self._pending = None
        body = {"seed": seed, "options": options}
        try:
            answer = self._request("POST", self._session_path("reset"), body, retry_sent=True)
        except RemoteEnvError as exc:
            if exc.status != 404:
                raise
            self._open()  # reaped while idle: a fresh session, then the same reset
            answer = self._request("POST", self._session_path("reset"), body, retry_sent=True)
        self._obs = decode_observation(answer["observation"])
        return self._obs, answer["info"]

    def _failed_step(self, error: str) -> tuple[dict, float, bool, bool, dict]:
        obs = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in (self._obs or {"text": ""}).items()}
        return obs, 0.0, True, False, {"failed": True, "error": error, "action_is_valid": True, "success": False}

    def _finish(self, answer: dict[str, Any]) -> tuple[dict, float, bool, bool, dict]:
        self._obs = decode_observation(answer["observation"])
        return self._obs, float(answer["reward"]), bool(answer["terminated"]), bool(answer["truncated"]), answer["info"]

    def step(self, action: str) -> tuple[dict, float, bool, bool, dict]:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == action:
            answer = pending[1]
            if "error" in answer:
                if answer.get("status") == 409:
                    raise RuntimeError(answer["error"])
                return self._failed_step(f"{self.url}: {answer['error']}")
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
        by_url: dict[str, list[tuple[RemoteEnv, str]]] = {}
        for env, reply in zip(envs, replies):
            if not env._closed:
                by_url.setdefault(env.url, []).append((env, reply if isinstance(reply, str) else ""))
        for members in by_url.values():
            if len(members) < 2:
                continue
            calls = [{"session": env._session, "op": "step", "action": reply} for env, reply in members]
            try:
                results = members[0][0]._request("POST", "/batch", {"calls": calls})["results"]
            except RemoteEnvError:
                continue  # each env asks on its own in step(), and reports its own fault
            for (env, reply), answer in zip(members, results):
                env._pending = (reply, answer)

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
                self._client.delete(f"/sessions/{self._session}", timeout=5.0)
        except httpx.HTTPError:
            pass  # the server reaps it when idle
        finally:
            self._client.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    # -- the task contract, answered by the served task ----------------------------------------
    def instructions(self) -> str:
        return self._call("instructions")

    def state_text(self) -> str:
        return self._call("state_text")

    def render_text(self) -> str:
        return self._call("render_text")

    def legal_actions(self) -> list[str]:
        return list(self._call("legal_actions"))

    def effective_actions(self) -> list[str]:
        return list(self._call("effective_actions"))

    def skips_noop_moves(self) -> bool:
        if self._skips_noop is None:
            self._skips_noop = bool(self._call("skips_noop_moves"))
        return self._skips_noop

    def format_reply(self, action: Any) -> str:
        return self._call("format_reply", action)

    def sample_reply(self, rng: np.random.Generator) -> str:
        """A uniformly drawn effective action in the task's reply format: the same draw from
        ``rng`` as :meth:`envs.MultiTurnEnv.sample_reply` makes in-process."""
        legal = self.effective_actions()
        if not legal:
            raise ValueError(f"{self.served_task}: effective_actions() is empty in this state")
        return self.format_reply(legal[int(rng.integers(len(legal)))])

    def describe_action(self, reply: str) -> str:
        return self._call("describe_action", reply)

    def outcome_text(self, terminated: bool, success: bool) -> str:
        return self._call("outcome_text", bool(terminated), bool(success))

    def lookahead_text(self) -> str:
        return self._call("lookahead_text")

    def aim_text(self) -> str:
        return self._call("aim_text")

    def subgoal_text(self) -> str:
        return self._call("subgoal_text")

    def subgoal_moves(self) -> list[str]:
        return list(self._call("subgoal_moves"))

    def tokenizer_text(self) -> str:
        return self._call("tokenizer_text")

    def render_image(self) -> np.ndarray:
        return decode_image(self._call("render_image"))


class RemoteVisionEnv(RemoteEnv):
    """A vision task on a ``python -m envs.serve`` server (``freshper/RemoteVision-v0``)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}
    modality: ClassVar[str] = "vision"


def server_info(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """``GET /info`` of a task server: its task id, modality, kwargs and limits."""
    resp = httpx.get(url.rstrip("/") + "/info", timeout=timeout)
    resp.raise_for_status()
    info = resp.json()
    if info.get("protocol") != PROTOCOL:
        raise RemoteEnvError(f"{url} speaks {info.get('protocol')!r}, not {PROTOCOL!r}")
    return info


def remote_id(url: str) -> str:
    """The id to play the task served at ``url`` with: ``freshper/Remote-v0`` or
    ``freshper/RemoteVision-v0``, by the served task's modality."""
    return "freshper/RemoteVision-v0" if server_info(url)["modality"] == "vision" else "freshper/Remote-v0"
