"""GEM compatibility, both ways (needs the optional extra ``.[gem]``: ``pip install gem-llm``).

**GEM's games as freshper tasks.** :class:`GemGameEnv` wraps one of GEM's offline games
(``gem_id="game:GuessTheNumber-v0-easy"``, ...) in the freshper contract, so ``train.py``,
``envs.play`` and the runners use it by id (``gem/GuessTheNumberEasy-v0`` and the other ids
registered in ``envs/_builtin.py``, or ``gem/Game-v0`` with any ``gem_id``):

- the first observation is GEM's instructions followed by its current state (GEM's ``suffix``:
  the board, or the prompt for the next guess); later ones are GEM's message about the move,
  the state and the turns left;
- replies are GEM's own (``\\boxed{...}``), or freshper's ``<answer>...</answer>``, which is
  handed to GEM as ``\\boxed{...}``. A reply with neither, or one GEM rejects as a format error
  (GEM ends its episode there), is an invalid reply here: state unchanged, format penalty (the
  move is tried on a copy of GEM's env first);
- reward and the end of the episode are GEM's; ``success`` is a terminal reward of at least
  GEM's success reward (1.0); random replies are GEM's ``sample_random_action`` (wrapped in
  ``\\boxed{}`` when GEM's sampler forgets it, as FifteenPuzzle's does);
- GEM's games draw from the global ``random`` and ``numpy.random`` modules; each env keeps its
  own states and swaps them in around every GEM call, so seeded resets are deterministic
  however many envs are interleaved, and the caller's global random state is left untouched.

Offline GEM games (no data download): GuessTheNumber, Mastermind, Minesweeper, Game2048,
Sokoban, FifteenPuzzle. Hangman, Wordle and WordSearch need NLTK's word list (a download);
Sudoku and TowerofHanoi have no random action; Crosswords needs pandas.

**freshper tasks through GEM.** :func:`register_in_gem` registers every freshper task with
GEM's registry as ``freshper:<Name-vN>`` (``freshper/Sokoban-v0`` -> ``freshper:Sokoban-v0``),
so ``gem.make`` and ``gem.make_vec`` (with GEM's wrappers and autoreset) build them:
:class:`FreshperGemEnv` speaks GEM's API (string observations, ``reset(seed)``,
``sample_random_action``, ``spawn``); a vision task's image is in ``info["image"]``.

Importing this module imports ``gem``, whose ``__init__`` configures the root logger; that
configuration is undone here, since a library must not choose the application's logging.
"""

from __future__ import annotations

import copy
import logging
import random
import re
from contextlib import contextmanager
from typing import Any, ClassVar, Iterator

import numpy as np

from envs._builtin import GEM_GAMES
from envs.base import COMMON_CLIENT_KWARGS, MultiTurnEnv, extract_tag

logger = logging.getLogger(__name__)

from envs._builtin import GEM_INSTALL_HINT as INSTALL_HINT  # noqa: E402


def _import_gem() -> Any:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
        import gem.core
        import gem.envs.registration
        import gem.utils.constants
    except ImportError as exc:
        raise ImportError(f"GEM environments need the gem-llm package, which is not installed: {INSTALL_HINT}") from exc
    finally:
        for handler in list(root.handlers):  # gem's import calls logging.basicConfig
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    return gem


gem = _import_gem()
_REWARDS = gem.utils.constants.LanguageGameReward
_BOXED = re.compile(r"\\boxed\{")

#: freshper ids of GEM's offline games (registered in envs/_builtin.py).
GAMES: dict[str, str] = dict(GEM_GAMES)


class _RandomStates:
    """Private states of the global ``random`` and ``numpy.random`` generators."""

    def __init__(self, seed: int) -> None:
        py, npr = random.getstate(), np.random.get_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        self.py, self.np = random.getstate(), np.random.get_state()
        random.setstate(py)
        np.random.set_state(npr)

    @contextmanager
    def active(self, keep: bool = True) -> Iterator[None]:
        """Run with these states in the global generators; ``keep``: store what the code drew."""
        py, npr = random.getstate(), np.random.get_state()
        random.setstate(self.py)
        np.random.set_state(self.np)
        try:
            yield
        finally:
            if keep:
                self.py, self.np = random.getstate(), np.random.get_state()
            random.setstate(py)
            np.random.set_state(npr)


class GemGameEnv(MultiTurnEnv):
    """One of GEM's games as a freshper task (see the module docstring).

    Args:
        gem_id: GEM's id, e.g. ``"game:Mastermind-v0-easy"``.
        max_turns: turn limit here (invalid replies count; they never reach GEM); default:
            GEM's own ``max_turns`` for the game.
        gem_kwargs: keyword arguments for ``gem.make``.
    """

    modality: ClassVar[str] = "text"
    client_kwargs: ClassVar = COMMON_CLIENT_KWARGS

    def __init__(self, gem_id: str, *, max_turns: int | None = None, format_penalty: float = -0.1,
                 render_mode: str | None = None, feedback: bool = True,
                 gem_kwargs: dict[str, Any] | None = None) -> None:
        registry = gem.envs.registration.ENV_REGISTRY
        if gem_id not in registry:
            games = sorted(k for k in registry if k.startswith("game:"))
            raise ValueError(f"GEM has no env {gem_id!r}; its games are {games}")
        self.gem_id = gem_id
        self._rng_states = _RandomStates(0)
        with self._rng_states.active():
            self.gem_env = gem.make(gem_id, **dict(gem_kwargs or {}))
        turns = max_turns if max_turns is not None else int(getattr(self.gem_env, "max_turns", 0) or 50)
        super().__init__(max_turns=turns, format_penalty=format_penalty, render_mode=render_mode, feedback=feedback)
        self._instructions = ""
        self._state = ""
        self._gem_truncated = False
        self.gem_reward = 0.0
        self._build_spaces()

    # -- MultiTurnEnv hooks --------------------------------------------------------------------
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        seed = int(self.np_random.integers(2**31))
        self._rng_states = _RandomStates(seed)
        with self._rng_states.active():
            obs, info = self.gem_env.reset(seed=seed)
        self._instructions = str(obs).strip()
        self._state = str(info.get("suffix", "")).strip()
        self._gem_truncated = False
        self.gem_reward = 0.0

    def instructions(self) -> str:
        return self._instructions

    def state_text(self) -> str:
        return self._state

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        content = extract_tag(reply)
        if content is not None:
            if not content:
                return None, "the answer is empty; write your move inside \\boxed{...} or <answer>...</answer>."
            action = f"\\boxed{{{content}}}"
        elif _BOXED.search(reply):
            action = reply
        else:
            return None, "no \\boxed{...} (or <answer>...</answer>) found; put your move inside \\boxed{...}."
        # Try the move on a copy: GEM ends its episode on a format error, which is an invalid
        # reply here (state unchanged), so only a move GEM accepts is applied.
        trial = copy.deepcopy(self.gem_env)
        with self._rng_states.active(keep=False):
            outcome = trial.step(action)
        obs, reward, terminated = outcome[0], float(outcome[1]), bool(outcome[2])
        if terminated and reward == _REWARDS.format_error_reward:
            message = str(obs).strip() or "GEM could not parse the move"
            return None, f"{message} (the move must be inside \\boxed{{...}})."
        return action, None

    def apply_action(self, action: str) -> tuple[float, str, bool, bool]:
        with self._rng_states.active():
            obs, reward, terminated, truncated, info = self.gem_env.step(action)
        self._state = str(info.get("suffix", "")).strip()
        self._gem_truncated = bool(truncated) and not bool(terminated)
        self.gem_reward = float(reward)
        success = bool(terminated) and float(reward) >= _REWARDS.success_reward
        return float(reward), str(obs).strip(), bool(terminated), success

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        if self._gem_truncated and not self._done:  # GEM's own turn limit
            self._done, truncated = True, True
        return obs, reward, terminated, truncated, info

    # -- the rest of the contract --------------------------------------------------------------
    def sample_reply(self, rng: np.random.Generator) -> str:
        """GEM's own random action, drawn from ``rng`` (in ``\\boxed{}``)."""
        states = _RandomStates(int(rng.integers(2**31)))
        with states.active():
            action = str(self.gem_env.sample_random_action())
        return action if _BOXED.search(action) else f"\\boxed{{{action}}}"

    def describe_action(self, reply: str) -> str:
        content = extract_tag(reply)
        if content is None:
            match = re.findall(r"\\boxed\{([^{}]*)\}", reply)
            content = match[-1] if match else reply.strip()
        return content

    def outcome_text(self, terminated: bool, success: bool) -> str:
        """``success``/``failure`` at the end, else GEM's state after the move."""
        if terminated:
            return "success" if success else "failure"
        return self._state

    def task_info(self) -> dict[str, Any]:
        return {"gem_id": self.gem_id, "gem_reward": self.gem_reward}


# -- freshper tasks through GEM ----------------------------------------------------------------
class FreshperGemEnv(gem.core.Env):
    """A freshper task behind GEM's ``Env`` API (what ``gem.make("freshper:...")`` returns).

    ``seed`` (GEM's ``make_vec`` passes one per env) seeds the first ``reset`` without a seed;
    later seedless resets continue the task's own generator, as gymnasium's do.
    """

    def __init__(self, task_id: str, seed: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        from envs.registry import make

        self.freshper_id = task_id
        self._kwargs = dict(kwargs)
        self.env = make(task_id, **kwargs)
        self._first_seed = seed
        self._rng = np.random.default_rng(seed)

    @staticmethod
    def _info(obs: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
        info = dict(info)
        if "image" in obs:
            info["image"] = obs["image"]
        return info

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:  # no global seeding (GEM's base does)
        if seed is None and self._first_seed is not None:
            seed, self._first_seed = self._first_seed, None
        obs, info = self.env.reset(seed=seed)
        return obs["text"], self._info(obs, info)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs["text"], float(reward), bool(terminated), bool(truncated), self._info(obs, info)

    def sample_random_action(self) -> str:
        return self.env.unwrapped.sample_reply(self._rng)

    def spawn(self, same_state: bool = False, **kwargs: Any) -> "FreshperGemEnv":
        if same_state:
            raise NotImplementedError("a freshper task cannot be copied mid-episode; spawn(same_state=False)")
        return FreshperGemEnv(self.freshper_id, **{**self._kwargs, **kwargs})

    def close(self) -> None:
        self.env.close()


def gem_id_of(env_id: str) -> str:
    """GEM's id for a freshper task: ``freshper/Sokoban-v0`` -> ``freshper:Sokoban-v0``."""
    return env_id.replace("/", ":", 1)


def register_in_gem() -> list[str]:
    """Register every freshper task (built-in and plugins) with GEM's registry; return the GEM
    ids added by this call (ids already there are left as they are, so it can run again)."""
    from envs.registry import registered_tasks

    registry = gem.envs.registration.ENV_REGISTRY
    added = []
    for spec in registered_tasks():
        if spec.id.startswith("gem/"):  # GEM's own games: use them in GEM directly
            continue
        gem_id = gem_id_of(spec.id)
        if gem_id not in registry:
            gem.register(gem_id, FreshperGemEnv, task_id=spec.id)
            added.append(gem_id)
    return added
