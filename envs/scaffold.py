"""``python -m envs new mypkg/MyTask-v0 [DIR]``: write a task plugin package that passes its own test.

The package (in ``DIR``, default ``./<namespace>``) holds:

- ``pyproject.toml`` with the ``freshper.envs`` entry point the registry reads, so installing
  the package registers the task (``pip install -e DIR``);
- ``<namespace>/tasks.py``: a task with the minimal contract (a digit to guess, with
  higher/lower feedback) to replace with your own;
- ``<namespace>/__init__.py``: ``register_all()``, registering the id lazily (listing tasks does
  not import the module);
- ``tests/test_task.py``: gymnasium's ``check_env``, a random episode played to the end and the
  random agent's replies always valid;
- ``README.md``: how to install, test, play and train it.
"""

from __future__ import annotations

import keyword
import re
import sys
from pathlib import Path

from envs.registry import validate_id

PYPROJECT = '''[build-system]
requires = ["setuptools>=68", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "{name}: a freshper task."
requires-python = ">=3.10"
dependencies = ["freshper"]

[project.optional-dependencies]
test = ["pytest>=8"]

# Installing the package registers its tasks: freshper calls register_all() on import.
[project.entry-points."freshper.envs"]
{package} = "{package}:register_all"

[tool.setuptools.packages.find]
include = ["{package}*"]
'''

INIT = '''"""{name}: freshper tasks, registered through the ``freshper.envs`` entry point."""

from envs import register


def register_all() -> None:
    """Called by freshper when ``envs`` is imported (the entry point in pyproject.toml)."""
    register("{env_id}", "{package}.tasks:{cls}", modality="text",
             description="Guess a hidden digit; the feedback says higher or lower.", kwargs={{"max_turns": 4}})
'''

TASKS = '''"""{env_id}: replace this task with yours (docs/hub.md in freshper lists the whole contract)."""

from __future__ import annotations

from typing import Any

from envs import MultiTurnEnv, extract_tag


class {cls}(MultiTurnEnv):
    """Guess a digit 0-9 in ``max_turns`` replies; after a wrong guess the feedback says higher or lower."""

    modality = "text"

    def __init__(self, max_turns: int = 4, render_mode: str | None = None, feedback: bool = True) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode, feedback=feedback)
        self.secret = 0
        self.last = "no guess yet"
        self._build_spaces()

    # the task
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        self.secret = int(self.np_random.integers(10))
        self.last = "no guess yet"

    def instructions(self) -> str:
        return "Guess the hidden digit (0-9). Reply with <answer>d</answer>, e.g. <answer>5</answer>."

    def state_text(self) -> str:
        return f"Last guess: {{self.last}}."

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        content = extract_tag(reply)
        if content is None or content not in list("0123456789"):
            return None, "answer one digit in an answer tag, e.g. <answer>5</answer>"
        return int(content), None

    def apply_action(self, action: int) -> tuple[float, str, bool, bool]:
        if action == self.secret:
            self.last = f"{{action}}, correct"
            return 1.0, "Correct.", True, True
        hint = "higher" if action < self.secret else "lower"
        self.last = f"{{action}}, the digit is {{hint}}"
        return 0.0, f"Wrong: the digit is {{hint}}.", False, False

    # random replies: the random agent and the embedded model's pretraining
    def legal_actions(self) -> list[str]:
        return list("0123456789")
'''

TEST = '''"""{env_id} keeps freshper's task contract (run: pytest)."""

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

import envs

ENV_ID = "{env_id}"


def test_the_task_is_registered_through_the_entry_point() -> None:
    spec = envs.task_spec(ENV_ID)
    assert spec.modality == "text" and spec.source == "{dist}"


def test_gymnasiums_checker_passes() -> None:
    env = gym.make(ENV_ID)
    check_env(env.unwrapped)
    env.close()


def test_a_random_episode_plays_to_the_end_with_valid_replies() -> None:
    env = gym.make(ENV_ID)
    rng = np.random.default_rng(0)
    for seed in range(5):
        obs, info = env.reset(seed=seed)
        assert "Guess" in info["instructions"] and isinstance(obs["text"], str)
        for _ in range(env.unwrapped.max_turns):
            obs, reward, terminated, truncated, info = env.step(env.unwrapped.sample_reply(rng))
            assert info["action_is_valid"]
            if terminated or truncated:
                break
        assert terminated or truncated
    # an invalid reply costs the format penalty and leaves the state alone
    env.reset(seed=0)
    obs, reward, *_ , info = env.step("no answer here")
    assert not info["action_is_valid"] and reward < 0
    env.close()
'''

README = '''# {dist}

A freshper task plugin: `{env_id}`.

```bash
pip install -e '.[test]'           # registers {env_id} (entry point freshper.envs)
pytest                              # gymnasium's checker, a random episode
python -m envs list | grep {package}
python -m envs.play {env_id} --random --seed 0
python train.py --env-id {env_id}   # from a freshper checkout with its trainer (.[train])
```

Edit `{package}/tasks.py`: the task contract is freshper's `envs.MultiTurnEnv` (docs/hub.md).
'''


def _camel_to_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


#: Top-level packages of this project: a plugin package of that name would shadow (or be shadowed
#: by) the project's own.
PROJECT_PACKAGES = frozenset({"envs", "agents", "replay", "learner", "train", "freshper", "tests", "benchmarks",
                              "experiments", "conftest"})


def scaffold(env_id: str, folder: str | Path | None = None, *, overwrite: bool = False) -> Path:
    """Write the plugin package for ``env_id`` (``namespace/Name-vN``) into ``folder``
    (default ``./<namespace>``); return the folder. Refuses a namespace naming one of the
    project's own packages or a standard-library module, a ``folder`` that is not a folder (a
    file, ``/dev/null``) and a non-empty folder unless ``overwrite``."""
    validate_id(env_id)
    namespace, rest = env_id.split("/")
    name = rest.rsplit("-v", 1)[0]
    package = namespace.replace("-", "_")
    if not package.isidentifier() or keyword.iskeyword(package):
        raise ValueError(f"the namespace {namespace!r} must be a Python package name (letters, digits, _)")
    if package in PROJECT_PACKAGES or package in getattr(sys, "stdlib_module_names", ()):
        whose = "this project's own package" if package in PROJECT_PACKAGES else "a standard-library module"
        raise ValueError(f"the namespace {namespace!r} would name the plugin package {package!r}, {whose}, which it "
                         "would shadow; choose another namespace (e.g. your project's name)")
    root = Path(folder) if folder is not None else Path(namespace)
    if (root.exists() or root.is_symlink()) and not root.is_dir():
        raise FileExistsError(f"{root} exists and is not a folder; choose another DIR")
    if root.exists() and any(root.iterdir()) and not overwrite:
        raise FileExistsError(f"{root} exists and is not empty; choose another DIR")
    fields = {"env_id": env_id, "name": name, "package": package, "dist": namespace, "cls": f"{name}Env",
              "module": _camel_to_snake(name)}
    files = {
        "pyproject.toml": PYPROJECT,
        f"{package}/__init__.py": INIT,
        f"{package}/tasks.py": TASKS,
        "tests/test_task.py": TEST,
        "README.md": README,
    }
    for rel, template in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(**fields), encoding="utf-8")
    return root
