"""verifiers environments as freshper tasks (extra ``.[verifiers]``: ``verifiers>=0.3.1,<0.4``).

:class:`VerifiersEnv` (``freshper/Verifiers-v0``) plays any environment written against
verifiers' classic API -- ``vf.MultiTurnEnv`` with its ``env_response`` hook, a
``vf.Rubric`` for the reward (``vf.SingleTurnEnv`` and other ``vf.Environment`` subclasses
whose rollout asks the model for plain-text replies too) -- as a gymnasium task:

- the environment is given as an object (``env=vf_env``), a factory ``"module:function"``
  called with ``env_args``, or an installed verifiers environment id (``env="wordle"``,
  loaded by ``vf.load_environment(id, **env_args)``); named environments are loaded once per
  process and shared, as verifiers shares one environment between its rollouts;
- ``reset(seed=s)`` picks a row of the environment's dataset with the task's generator
  (``options={"index": i}`` picks row ``i``; ``split="eval"`` uses its eval dataset) and
  starts verifiers' own rollout on it (``Environment.run_rollout``). The rollout runs on a
  background event loop with a model client whose model is the gym agent: each model call
  hands the prompt to freshper and waits for the reply ``step`` brings;
- observations are the conversation's latest messages as text: at reset the prompt (system
  messages are ``info["instructions"]`` and come first), after a step the messages the
  environment appended after the reply (its ``env_response``; at the end its
  ``final_env_response``, if any). A user message is its text; when other roles appear (a
  few-shot prompt) each message is written ``role: text``; an image part is ``[image]``;
- the action is the reply text (a non-string reply is sent as ``""``); every reply is
  valid -- what a malformed reply is worth is the rubric's business;
- the episode ends when verifiers' rollout ends (its stop conditions, ``max_turns``
  included). The last step's reward is the rubric's weighted reward; ``info["metrics"]``
  holds every reward function's and metric's score, ``info["stop_condition"]`` why it
  ended; earlier steps give 0. ``success`` is a reward of at least ``success_threshold``
  (default: the environment's ``pass_threshold``, 0.5). A rollout verifiers cuts short (its
  ``is_truncated``: an overlong prompt or reply; its timeout; its token budget) is
  ``truncated``; any other end, its ``max_turns`` included (a single-turn environment ends
  there), is ``terminated``. A rollout verifiers ends with an error has ``info["failed"]`` and
  ``info["error"]`` (an infrastructure fault, not learned from); an exception the
  environment's own code raises is raised by ``step``;
- ``max_turns`` (default: the environment's ``max_turns``, else 100) caps the replies here
  too: past it the rollout is cancelled, unscored, and the step is ``truncated`` with
  reward 0;
- environments whose rubric scores whole groups of rollouts at once cannot score one
  episode and are refused; so are replies that must be tool calls (a text reply carries
  none).

Register an environment under its own id with :func:`register_verifiers_env`::

    register_verifiers_env("verifiers/Wordle-v0", "wordle")   # then gym.make("verifiers/Wordle-v0")
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import json
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

import numpy as np

from envs._builtin import VERIFIERS_INSTALL_HINT as INSTALL_HINT
from envs.adapters.external import Exchange, ExternalEnv, failed_info
#: verifiers' stop conditions that cut a rollout short (beside its own ``is_truncated`` flag).
_CUT_SHORT = frozenset({"timeout_reached", "prompt_too_long", "max_total_completion_tokens_reached"})
_DEFAULT_MAX_TURNS = 100


def import_verifiers() -> Any:
    """verifiers' classic API (``verifiers.legacy`` in verifiers 0.3.x), or an ``ImportError``
    saying what to install."""
    try:
        import verifiers
    except ImportError as exc:
        raise ImportError(f"verifiers environments need the verifiers package, which is not installed: "
                          f"{INSTALL_HINT}") from exc
    try:
        import verifiers.legacy as vf
    except ImportError as exc:
        version = getattr(verifiers, "__version__", "?")
        raise ImportError(
            f"verifiers {version} is installed, but the adapter needs verifiers' classic environment API "
            f"(MultiTurnEnv.env_response, Rubric), which verifiers 0.3.x keeps as verifiers.legacy and 0.4 "
            f"removed: {INSTALL_HINT}") from exc
    return vf


# -- loading environments ----------------------------------------------------------------------
_LOADED: dict[str, Any] = {}
_LOADED_LOCK = threading.Lock()


def load_verifiers_env(env: Any, env_args: dict[str, Any] | None = None) -> Any:
    """A verifiers ``Environment`` from an object, a factory (a callable or ``"module:function"``,
    called with ``env_args``) or an installed environment id (``vf.load_environment``).
    Environments given by name are loaded once per process (same name and arguments)."""
    vf = import_verifiers()
    args = dict(env_args or {})
    if isinstance(env, vf.Environment):
        if args:
            raise ValueError("env_args are the arguments of a factory or an environment id; "
                             "they cannot be applied to an Environment object")
        return env
    if isinstance(env, str):
        key = json.dumps([env, args], sort_keys=True, default=repr)
        with _LOADED_LOCK:
            if key not in _LOADED:
                _LOADED[key] = _build(vf, env, args)
            return _LOADED[key]
    if callable(env):
        return _build(vf, env, args)
    raise TypeError(f"env must be a verifiers Environment, a factory ('module:function' or a callable) or "
                    f"an installed verifiers environment id, got {type(env).__name__}")


@contextlib.contextmanager
def _host_signal_handlers() -> Any:
    """Put the host's SIGINT and SIGTERM handlers back after the block: building a verifiers
    ``Environment`` installs process-wide ones (SIGTERM becomes ``exit(143)``, a ``SystemExit``
    raised inside whatever code runs when the signal arrives)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():  # elsewhere no handler can be set
            for sig, handler in saved.items():
                if handler is not None and signal.getsignal(sig) is not handler:
                    signal.signal(sig, handler)


def _build(vf: Any, env: str | Callable[..., Any], args: dict[str, Any]) -> Any:
    with _host_signal_handlers():
        return _build_env(vf, env, args)


def _build_env(vf: Any, env: str | Callable[..., Any], args: dict[str, Any]) -> Any:
    if callable(env):
        made, what = env(**args), getattr(env, "__qualname__", repr(env))
    elif ":" in env:
        module_name, _, attr = env.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ImportError(f"verifiers environment factory {env!r} could not be loaded: {exc}") from exc
        made, what = factory(**args), env
    else:
        made, what = vf.load_environment(env, **args), f"verifiers environment {env!r}"
    if not isinstance(made, vf.Environment):
        raise TypeError(f"{what} returned a {type(made).__name__}, not a verifiers Environment")
    return made


# -- the rollout, run by verifiers on a background event loop ------------------------------------
_LOOP: tuple[int, asyncio.AbstractEventLoop] | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for verifiers rollouts, in a daemon thread (a new one after a fork)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP[0] != os.getpid() or _LOOP[1].is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="freshper-verifiers", daemon=True).start()
            _LOOP = (os.getpid(), loop)
            atexit.register(_cancel_rollouts, loop)
        return _LOOP[1]


def _cancel_rollouts(loop: asyncio.AbstractEventLoop, wait: float = 5.0) -> None:
    """At exit: cancel the rollouts of episodes left open, so verifiers' cleanup handlers run."""
    if loop.is_closed() or not loop.is_running():
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=wait)
    except Exception:  # cleanup that hangs must not hang the interpreter's exit
        pass


_CLIENT_CLASS: type | None = None


def _client_class(vf: Any) -> type:
    """``vf.Client`` subclass whose model is the gym agent (built once verifiers is imported)."""
    global _CLIENT_CLASS
    if _CLIENT_CLASS is not None:
        return _CLIENT_CLASS
    from verifiers.legacy.types import Response, ResponseMessage

    class GymAgentClient(vf.Client):
        """Each model call hands the prompt to the gym side and returns the reply ``step`` brings."""

        def __init__(self, rollout: "_Rollout") -> None:
            super().__init__(None)
            self._rollout = rollout
            self._calls = 0

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[list, dict]:
            return list(messages), {}

        async def get_native_response(self, prompt: list, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> tuple[str, str]:
            return model, await self._rollout.ask(prompt)

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: tuple[str, str]) -> Any:
            model, reply = response
            self._calls += 1
            message = ResponseMessage(role="assistant", content=reply, finish_reason="stop", is_truncated=False)
            return Response(id=f"freshper-{self._calls}", created=int(time.time()), model=model, message=message)

        async def close(self) -> None:
            return None

    _CLIENT_CLASS = GymAgentClient
    return GymAgentClient


class _Rollout:
    """One verifiers rollout on the background loop, paused at each model call.

    Events for the gym side arrive on a queue: ``("prompt", messages)`` when the rollout asks
    for a reply, then ``("done", output)`` (verifiers' scored ``RolloutOutput``), ``("error",
    exception)`` or ``("cancelled", None)``.
    """

    def __init__(self, vf_env: Any, row: dict[str, Any], client_cls: type, model: str,
                 sampling_args: dict[str, Any]) -> None:
        self.events: queue.Queue = queue.Queue()
        self._reply: asyncio.Future | None = None
        self.loop = _event_loop()
        coro = self._run(vf_env, row, client_cls(self), model, sampling_args)
        self.future = asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _run(self, vf_env: Any, row: dict[str, Any], client: Any, model: str,
                   sampling_args: dict[str, Any]) -> None:
        try:
            output = await vf_env.run_rollout(row, client, model, sampling_args)
        except asyncio.CancelledError:
            self.events.put(("cancelled", None))
            raise
        except Exception as exc:  # the environment's own code failed: step() raises it
            self.events.put(("error", exc))
        else:
            self.events.put(("done", output))

    async def ask(self, prompt: list) -> str:
        self._reply = asyncio.get_running_loop().create_future()
        self.events.put(("prompt", prompt))
        return await self._reply

    def send(self, reply: str) -> None:
        future = self._reply

        def deliver() -> None:
            if future is not None and not future.done():
                future.set_result(reply)

        self.loop.call_soon_threadsafe(deliver)

    def next_event(self, timeout: float) -> tuple[str, Any]:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return "timeout", None

    def cancel(self, wait: float = 10.0) -> None:
        """Cancel the rollout and give verifiers' cleanup handlers up to ``wait`` seconds."""
        if self.future.done():
            return
        self.future.cancel()
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            kind, _ = self.next_event(left)
            if kind in ("cancelled", "done", "error", "timeout"):
                return


# -- messages as text ----------------------------------------------------------------------------
def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = _field(part, "type")
        if kind in ("image_url", "input_image", "image"):
            parts.append("[image]")
        else:
            parts.append(str(_field(part, "text") or ""))
    return "\n".join(p for p in parts if p)


def messages_text(messages: list) -> str:
    """Messages as one text: user messages as their text; when another role appears, every
    message as ``role: text``. Messages are separated by a blank line."""
    labelled = any(_field(m, "role") != "user" for m in messages)
    texts = []
    for m in messages:
        text = _content_text(_field(m, "content"))
        texts.append(f"{_field(m, 'role')}: {text}" if labelled else text)
    return "\n\n".join(texts)


def _after_last_reply(messages: list) -> list:
    """The messages after the last assistant message (all of them when there is none)."""
    last = max((i for i, m in enumerate(messages) if _field(m, "role") == "assistant"), default=-1)
    return list(messages[last + 1:])


# -- the task ------------------------------------------------------------------------------------
class VerifiersEnv(ExternalEnv):
    """A verifiers environment as a freshper task (see the module docstring; the contract's
    shared part is :class:`envs.adapters.external.ExternalEnv`).

    Args:
        env: a verifiers ``Environment``, a factory (``"module:function"`` or a callable) or an
            installed verifiers environment id.
        env_args: keyword arguments of the factory or of the environment's ``load_environment``.
        split: ``"train"`` (the environment's dataset, else its eval dataset) or ``"eval"``.
        max_turns: cap on replies here (default: the environment's ``max_turns``, else 100).
        success_threshold: ``success`` is a reward of at least this (default: the
            environment's ``pass_threshold``).
        model: the model name verifiers records in its rollout state.
        sampling_args: verifiers' sampling arguments (recorded in its state; the agent samples).
        timeout: seconds to wait for the environment's response to a reply; past it the
            episode ends with ``info["failed"]``.
    """

    def __init__(self, env: Any, *, env_args: dict[str, Any] | None = None, split: str = "train",
                 max_turns: int | None = None, success_threshold: float | None = None, model: str = "freshper",
                 sampling_args: dict[str, Any] | None = None, timeout: float = 600.0,
                 render_mode: str | None = None, max_text_length: int = 1 << 20) -> None:
        vf = import_verifiers()
        self.vf_env = load_verifiers_env(env, env_args)
        if self.vf_env.requires_group_rollouts:
            raise ValueError(f"{type(self.vf_env).__name__}'s rubric has group reward functions (they score "
                             "several rollouts together), so one episode cannot be scored")
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.split = split
        self.dataset = self._dataset(split)
        if len(self.dataset) == 0:
            raise ValueError(f"{type(self.vf_env).__name__}'s {split} dataset is empty")
        own_turns = int(getattr(self.vf_env, "max_turns", -1) or -1)
        turns = max_turns if max_turns is not None else own_turns if own_turns > 0 else _DEFAULT_MAX_TURNS
        super().__init__(max_turns=turns, render_mode=render_mode, max_text_length=max_text_length)
        self.success_threshold = float(success_threshold if success_threshold is not None
                                       else getattr(self.vf_env, "pass_threshold", 0.5))
        self.model = str(model)
        self.sampling_args = dict(sampling_args or {})
        self.timeout = float(timeout)
        self._client_cls = _client_class(vf)
        self._rollout: _Rollout | None = None
        self._index = -1
        self._example_id: Any = None
        self._build_spaces()

    def _dataset(self, split: str) -> Any:
        env = self.vf_env
        if split == "eval":
            return env.get_eval_dataset()
        if env.build_dataset() is None:
            return env.get_eval_dataset()
        return env.get_dataset()

    # -- episodes --------------------------------------------------------------------------------
    def _stop(self) -> None:
        if self._rollout is not None:
            self._rollout.cancel()
            self._rollout = None

    def _reset_task(self, options: dict[str, Any] | None) -> None:
        self._stop()
        options = options or {}
        if "index" in options:
            index = int(options["index"])
            if not 0 <= index < len(self.dataset):
                raise ValueError(f"options['index'] must be in [0, {len(self.dataset)}), got {index}")
        else:
            index = int(self.np_random.integers(len(self.dataset)))
        row = dict(self.dataset[index])
        self._index, self._example_id = index, row.get("example_id")
        self._rollout = _Rollout(self.vf_env, row, self._client_cls, self.model, self.sampling_args)
        kind, payload = self._rollout.next_event(self.timeout)
        if kind != "prompt":
            rollout, self._rollout = self._rollout, None
            if kind == "error":
                message = f"the verifiers environment failed before its first model call: {payload!r}"
                raise RuntimeError(message) from payload
            if kind == "timeout":
                rollout.cancel()
                raise TimeoutError(f"the verifiers environment did not ask for a reply within {self.timeout:g} s")
            reason = payload.get("stop_condition") if isinstance(payload, dict) else kind
            error = payload.get("error_chain") if isinstance(payload, dict) else None
            raise RuntimeError(f"the verifiers rollout of dataset row {index} ended before asking for a reply "
                               f"(stop condition {reason!r}{', error ' + str(error) if error else ''})")
        self._instructions = "\n\n".join(_content_text(_field(m, "content")) for m in payload
                                         if _field(m, "role") == "system")
        self._text = messages_text([m for m in payload if _field(m, "role") != "system"])

    def exchange(self, reply: str) -> Exchange:
        rollout = self._rollout
        if rollout is None:
            raise RuntimeError("step() called before reset()")
        rollout.send(reply)
        kind, payload = rollout.next_event(self.timeout)
        if kind == "prompt":
            text = messages_text(_after_last_reply(payload))
            if self.turn < self.max_turns:
                return Exchange(text)
            self._stop()  # the rollout waits for a reply that will not come
            return Exchange(text, truncated=True)
        if kind == "done":
            self._rollout = None
            reward = float(payload.get("reward") or 0.0)
            stop = payload.get("stop_condition")
            truncated = stop in _CUT_SHORT or bool(payload.get("is_truncated"))
            success = payload.get("error") is None and reward >= self.success_threshold
            info: dict[str, Any] = {"stop_condition": stop,
                                    "metrics": {k: float(v) for k, v in (payload.get("metrics") or {}).items()}}
            if payload.get("error") is not None:
                info.update(failed=True, error=str(payload.get("error_chain") or payload["error"]))
            return Exchange(messages_text(_after_last_reply(payload.get("completion") or [])), reward,
                            terminated=not truncated, truncated=truncated, success=success, info=info)
        if kind == "error":
            self._rollout, self._done = None, True
            raise RuntimeError(f"the verifiers environment raised during its rollout: {payload!r}") from payload
        self._stop()  # the environment did not answer in time
        return Exchange("", truncated=True,
                        info=failed_info(f"the verifiers environment did not respond within {self.timeout:g} s"))

    def sample_reply(self, rng: np.random.Generator) -> str:
        """One to three words of the latest observation, in the environment's XML format when
        its parser is an ``XMLParser`` (every field holding the words)."""
        text = super().sample_reply(rng)
        parser = getattr(self.vf_env, "parser", None)
        fields = getattr(parser, "get_fields", None)
        if callable(fields) and callable(getattr(parser, "format", None)):
            try:
                return parser.format(**{name: text for name in fields()})
            except Exception:  # a parser whose format needs more than text: plain words
                pass
        return text

    def task_info(self) -> dict[str, Any]:
        example_id = self._example_id
        if not isinstance(example_id, (int, str)) or isinstance(example_id, bool):
            example_id = None if example_id is None else str(example_id)
        return {"index": self._index, "example_id": example_id}


def register_verifiers_env(task_id: str, env: Any, *, env_args: dict[str, Any] | None = None,
                           description: str = "", override: bool = False, **kwargs: Any) -> Any:
    """Register a verifiers environment under its own id, e.g. ``verifiers/Wordle-v0``:
    ``env`` and ``env_args`` as for :class:`VerifiersEnv`, other keyword arguments become the
    task's defaults. Returns the :class:`~envs.registry.TaskSpec`."""
    from envs.registry import register

    name = env if isinstance(env, str) else type(env).__name__
    return register(task_id, "envs.adapters.verifiers:VerifiersEnv", modality="text",
                    description=description or f"The verifiers environment {name}.",
                    kwargs={"env": env, "env_args": dict(env_args or {}), **kwargs}, override=override,
                    requires=("verifiers",), install_hint=INSTALL_HINT)
