"""OpenEnv environments as freshper tasks (extra ``.[openenv]``: ``openenv-core>=0.2.1,<0.4``).

:class:`OpenEnvEnv` (``freshper/OpenEnv-v0``) plays an OpenEnv environment server -- one
started with openenv-core's ``create_app``, a Hugging Face Space, a container -- at ``url``
through openenv-core's own client (``GenericEnvClient``, used synchronously), over the
server's WebSocket session (``/ws``): one session per task instance, opened at the first reset
and kept across episodes, so the server keeps the environment's state between steps (its
HTTP ``/reset`` and ``/step`` build a fresh environment for every request and cannot play an
episode).

- ``reset(seed=s)`` resets the server's environment with a seed drawn from the task's
  generator (so seeded resets are deterministic and seedless ones continue the sequence);
  ``reset_kwargs`` go with it;
- the action is the reply text, sent as the action field ``action_field`` (default
  ``"message"``, the field of OpenEnv's echo and text-game environments) beside the
  constant fields ``action_extra``; a non-string reply is sent as ``""``;
- the observation is text: the observation's field ``observation_field`` when given, else
  its only field when it has one and that is a string, else every field as ``name: value``
  lines (non-strings as JSON).
  ``instructions`` (default none) go before the first observation and in
  ``info["instructions"]``; ``info["observation"]`` is the observation as the server sent it;
- reward and the end of the episode are the server's (a missing reward is 0); ``success``
  is an episode the server ends with a reward of at least ``success_threshold`` (1.0);
  ``max_turns`` (100) truncates;
- a server that cannot be reached makes ``reset`` raise; a connection lost or a timeout
  mid-episode ends it with ``info["failed"]`` (an infrastructure fault, not learned from),
  and the next reset opens a new session; an error the server answers a step with (an
  action its schema rejects, the environment raising) is raised by ``step`` with its
  message.
"""

from __future__ import annotations

import json
from typing import Any

from envs._builtin import OPENENV_INSTALL_HINT as INSTALL_HINT
from envs.adapters.external import Exchange, ExternalEnv, failed_info

_SKIP_FIELDS = frozenset({"done", "reward", "metadata"})


def import_openenv_client() -> type:
    """openenv-core's ``GenericEnvClient``, or an ``ImportError`` saying what to install."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as exc:
        raise ImportError(f"OpenEnv environments need the openenv-core package, which is not installed: "
                          f"{INSTALL_HINT}") from exc
    return GenericEnvClient


def observation_text(observation: dict[str, Any], field: str | None = None) -> str:
    """An OpenEnv observation as text (see the module docstring)."""
    if field is not None:
        if field not in observation:
            raise KeyError(f"the observation has no field {field!r}; its fields are {sorted(observation)}")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, default=str)
    fields = {k: v for k, v in observation.items() if k not in _SKIP_FIELDS}
    strings = [v for v in fields.values() if isinstance(v, str)]
    if len(strings) == 1 and len(fields) == 1:
        return strings[0]
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in fields.items())


class OpenEnvEnv(ExternalEnv):
    """An OpenEnv environment server as a freshper task (see the module docstring; the
    contract's shared part is :class:`envs.adapters.external.ExternalEnv`).

    Args:
        url: the server's base URL (``http://host:port``, or ``ws://``).
        action_field: the action field that carries the reply text.
        action_extra: other action fields, sent unchanged with every step.
        observation_field: the observation field to show (default: see the module docstring).
        instructions: text shown before the first observation.
        reset_kwargs: extra keyword arguments of the server's ``reset``.
        success_threshold: an episode the server ends with at least this reward is a success.
        connect_timeout, message_timeout: seconds to open the session and to wait for an answer.
    """

    def __init__(self, url: str, *, action_field: str = "message", action_extra: dict[str, Any] | None = None,
                 observation_field: str | None = None, instructions: str = "",
                 reset_kwargs: dict[str, Any] | None = None, max_turns: int = 100,
                 success_threshold: float = 1.0, connect_timeout: float = 10.0, message_timeout: float = 60.0,
                 render_mode: str | None = None, max_text_length: int = 1 << 20) -> None:
        self._client_cls = import_openenv_client()
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be the OpenEnv server's base URL, e.g. 'http://127.0.0.1:8000', "
                             f"got {url!r}")
        super().__init__(max_turns=max_turns, render_mode=render_mode, max_text_length=max_text_length)
        self.url = url
        self.action_field = str(action_field)
        self.action_extra = dict(action_extra or {})
        if self.action_field in self.action_extra:
            raise ValueError(f"action_extra may not set the reply's own field {self.action_field!r}")
        self.observation_field = observation_field
        self._instructions = str(instructions)
        self.reset_kwargs = dict(reset_kwargs or {})
        self.success_threshold = float(success_threshold)
        self.connect_timeout = float(connect_timeout)
        self.message_timeout = float(message_timeout)
        self._client: Any = None
        self._observation: dict[str, Any] = {}
        self._server_seed = 0
        self._build_spaces()

    # -- the session -----------------------------------------------------------------------------
    def _session(self) -> Any:
        if self._client is None:
            client = self._client_cls(base_url=self.url, connect_timeout_s=self.connect_timeout,
                                      message_timeout_s=self.message_timeout)
            if hasattr(client, "sync"):  # from openenv-core 0.2.3 the client is async, with a sync() wrapper
                client = client.sync()
            client.connect()  # raises ConnectionError naming the URL
            self._client = client
        return self._client

    def _stop(self) -> None:
        """Close the session (the next reset opens a new one)."""
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # the connection is gone already
                pass

    def _show(self, observation: Any) -> None:
        self._observation = dict(observation or {})
        self._text = observation_text(self._observation, self.observation_field)

    # -- episodes --------------------------------------------------------------------------------
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        self._server_seed = int(self.np_random.integers(2**31))
        try:
            result = self._session().reset(seed=self._server_seed, **self.reset_kwargs)
        except RuntimeError as exc:  # the server answered with an error
            self._stop()
            raise RuntimeError(f"OpenEnv server {self.url} refused the reset: {exc}") from exc
        except ConnectionError:  # the server cannot be reached
            self._stop()
            raise
        except Exception as exc:  # a session that went stale between episodes: open a new one
            self._stop()
            try:
                result = self._session().reset(seed=self._server_seed, **self.reset_kwargs)
            except Exception as again:
                self._stop()
                raise ConnectionError(f"OpenEnv server {self.url} failed to reset: {again!r}") from exc
        self._show(result.observation)

    def exchange(self, reply: str) -> Exchange:
        if self._client is None:
            raise RuntimeError("step() called before reset()")
        payload = {**self.action_extra, self.action_field: reply}
        try:
            result = self._client.step(payload)
        except RuntimeError as exc:  # the server's error answer
            raise RuntimeError(f"OpenEnv server {self.url} rejected the step (the reply goes in action field "
                               f"{self.action_field!r}): {exc}") from exc
        except Exception as exc:  # the connection is lost, or the server did not answer in time
            self._stop()
            return Exchange("", truncated=True, info=failed_info(f"OpenEnv server {self.url}: {exc!r}"))
        self._show(result.observation)
        reward = float(result.reward) if result.reward is not None else 0.0
        terminated = bool(result.done)
        return Exchange(self._text, reward, terminated, success=terminated and reward >= self.success_threshold)

    def task_info(self) -> dict[str, Any]:
        return {"observation": dict(self._observation), "server_seed": self._server_seed}
