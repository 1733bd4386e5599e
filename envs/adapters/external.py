"""The shared base of tasks whose episodes run in an external environment.

An adapter (:mod:`envs.adapters.verifiers`, :mod:`envs.adapters.openenv`) hands each reply,
whole, to something outside freshper -- a verifiers rollout, an OpenEnv server -- and shows
what comes back. :class:`ExternalEnv` is the task contract for all of them: the reply is the
action (``parse_action`` takes it as it is, so no reply is a format error here: the external
environment judges it), ``apply_action`` hands it over through the adapter's :meth:`exchange`,
and ``step`` turns the :class:`Exchange` into gymnasium's five values. An adapter defines
:meth:`ExternalEnv._reset_task` (begin an episode; set ``_instructions`` and ``_text``),
:meth:`ExternalEnv.exchange`, :meth:`ExternalEnv.task_info` and, when it holds something
outside (a session, a rollout), :meth:`ExternalEnv._stop`.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from envs.base import MultiTurnEnv


def failed_info(error: str, **more: Any) -> dict[str, Any]:
    """``info`` of a step that failed outside the agent (a lost connection, a timeout, an
    environment's own error): trainers count it as an infrastructure fault, not a policy failure."""
    return {"failed": True, "error": error, "action_is_valid": True, "success": False, **more}


@dataclass
class Exchange:
    """What the external environment answered a reply with."""

    #: The new observation's text.
    text: str
    reward: float = 0.0
    terminated: bool = False
    #: Cut short by the environment (its own turn limit, a timeout, a lost connection).
    truncated: bool = False
    success: bool = False
    #: Entries added to the step's ``info`` (e.g. :func:`failed_info`'s, a stop condition).
    info: dict[str, Any] = field(default_factory=dict)


class ExternalEnv(MultiTurnEnv, metaclass=abc.ABCMeta):
    """A text task played in an external environment (see the module docstring). ``step``
    truncates at ``max_turns`` where the environment did not end the episode itself."""

    modality: ClassVar[str] = "text"

    def __init__(self, *, max_turns: int, render_mode: str | None = None, max_text_length: int = 1 << 20) -> None:
        super().__init__(max_turns=max_turns, format_penalty=0.0, render_mode=render_mode,
                         max_text_length=max_text_length)
        self._instructions = ""
        self._text = ""
        self._playing = False  # reset() began an episode that has not ended
        self._last: Exchange | None = None

    # -- what an adapter defines ---------------------------------------------------------------
    @abc.abstractmethod
    def exchange(self, reply: str) -> Exchange:
        """Hand ``reply`` to the external environment and return its answer; called by
        ``apply_action`` once per step (``self.turn`` already counts it). Raise for an error the
        agent's reply caused (the caller's to see), answer with :func:`failed_info` for an
        infrastructure fault."""

    @abc.abstractmethod
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        """Begin an episode in the external environment; set ``_instructions`` and ``_text``."""

    def _stop(self) -> None:
        """Release what the external environment holds for this env (a session, a rollout)."""

    # -- the contract, shared -------------------------------------------------------------------
    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        gym.Env.reset(self, seed=seed)
        self._playing = False
        self._reset_task(options)
        self._playing = True
        self.turn, self.episode_return, self._done, self._success = 0, 0.0, False, False
        text = f"{self._instructions}\n\n{self._text}" if self._instructions else self._text
        info = {"instructions": self._instructions, "action_is_valid": True, "success": False, "turn": 0}
        info.update(self.task_info())
        return {"text": text}, info

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        return (reply if isinstance(reply, str) else ""), None

    def apply_action(self, action: Any) -> tuple[float, str, bool, bool]:
        """The reply handed to the external environment: ``(reward, feedback, terminated,
        success)`` of its answer (no feedback: the answer's text is the observation); the whole
        answer is kept for ``step``."""
        self._last = answer = self.exchange(action if isinstance(action, str) else "")
        return float(answer.reward), "", bool(answer.terminated), bool(answer.success)

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        if not self._playing:
            raise RuntimeError("step() called before reset()")
        self.turn += 1
        reply, _ = self.parse_action(action)
        reward, _, terminated, success = self.apply_action(reply)
        answer = self._last
        assert answer is not None
        self._text = answer.text
        truncated = not terminated and (bool(answer.truncated) or self.turn >= self.max_turns)
        self._done = terminated or truncated
        self._playing = not self._done
        self._success = success
        self.episode_return += reward
        info = {"action_is_valid": True, "success": success, "turn": self.turn}
        info.update(self.task_info())
        info.update(answer.info)
        return {"text": self._text}, reward, terminated, truncated, info

    def instructions(self) -> str:
        return self._instructions

    def state_text(self) -> str:
        return self._text

    def sample_reply(self, rng: np.random.Generator) -> str:
        """One to three words of the latest observation (a random agent's reply)."""
        words = re.findall(r"[A-Za-z0-9]+", self._text) or ["yes"]
        return " ".join(words[int(rng.integers(len(words)))] for _ in range(int(rng.integers(1, 4))))

    def close(self) -> None:
        self._stop()
        super().close()
