"""The shared base of the adapters of external environments (``envs/adapters/external.py``):
a task defined by its exchange alone plays the whole contract, and the shipped adapters define
only their part of it (no ``step``, ``reset`` or ``apply_action`` of their own, nothing left
raising ``NotImplementedError``)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envs.adapters.external import Exchange, ExternalEnv, failed_info

REPO = Path(__file__).resolve().parents[2]


class Parrot(ExternalEnv):
    """An external environment in a few lines: it repeats the reply; "stop" ends the episode
    with a reward of 1, "crash" is an infrastructure fault."""

    def __init__(self, max_turns: int = 3) -> None:
        super().__init__(max_turns=max_turns)
        self.exchanges: list[str] = []
        self._build_spaces()

    def _reset_task(self, options):
        self.exchanges = []
        self._instructions = "Say stop."
        self._text = f"ready {int(self.np_random.integers(100))}"

    def exchange(self, reply: str) -> Exchange:
        self.exchanges.append(reply)
        if reply == "crash":
            return Exchange("", truncated=True, info=failed_info("the parrot flew away"))
        stop = reply == "stop"
        return Exchange(f"you said {reply}", reward=1.0 if stop else 0.0, terminated=stop, success=stop)

    def task_info(self):
        return {"heard": len(self.exchanges)}


def test_a_task_defined_by_its_exchange_plays_the_whole_contract() -> None:
    env = Parrot()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("stop")
    obs, info = env.reset(seed=3)
    assert obs["text"] == f"Say stop.\n\n{env.state_text()}" and info["instructions"] == "Say stop."
    assert env.reset(seed=3)[0] == obs  # seeded through the task's generator
    obs, reward, terminated, truncated, info = env.step("hello")
    assert (obs["text"], reward, terminated, truncated) == ("you said hello", 0.0, False, False)
    assert info == {"action_is_valid": True, "success": False, "turn": 1, "heard": 1}
    obs, reward, terminated, truncated, info = env.step("stop")
    assert (reward, terminated, truncated, info["success"], env.episode_return) == (1.0, True, False, True, 1.0)
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("again")
    env.reset(seed=1)  # max_turns truncates an episode the environment did not end
    *_, terminated, truncated, _ = env.step("a")
    assert not truncated
    env.step("b")
    *_, terminated, truncated, _ = env.step("c")
    assert truncated and not terminated
    env.reset(seed=2)  # an infrastructure fault ends the episode, marked as one
    obs, reward, terminated, truncated, info = env.step("crash")
    assert info["failed"] and info["error"] == "the parrot flew away" and truncated and reward == 0.0
    env.reset(seed=2)
    assert env.apply_action("stop") == (1.0, "", True, True)  # the contract's own entry
    assert env.parse_action(5) == ("", None)
    rng = np.random.default_rng(0)
    assert set(env.sample_reply(rng).split()) <= set(env.state_text().split())
    check_env(Parrot(), skip_render_check=True)


def test_the_shipped_adapters_define_only_their_part() -> None:
    from envs.adapters.openenv import OpenEnvEnv
    from envs.adapters.verifiers import VerifiersEnv

    for cls in (OpenEnvEnv, VerifiersEnv):
        assert issubclass(cls, ExternalEnv) and not inspect.isabstract(cls)
        assert not {"step", "reset", "apply_action", "parse_action", "instructions", "state_text"} & set(vars(cls))
    for path in [REPO / "envs" / "remote.py", *sorted((REPO / "envs" / "adapters").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                assert getattr(called, "id", None) != "NotImplementedError", f"{path.name}:{node.lineno}"
