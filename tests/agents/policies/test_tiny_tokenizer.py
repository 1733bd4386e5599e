"""The embedded tiny model's tokenizer text: what it learns from, and what its cache key depends on.

The shared tokenizer learns from the tasks that ship with freshper alone, so the default model
(and ``make train``'s cached pretraining) is the same whatever else is installed; a task of a
plugin, or one registered at run time, gets a tokenizer of its own. A task that keeps every
default of the contract (``format_reply`` included) has its replies in its tokenizer's text.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

import envs
from agents.policies import tiny
from envs import MultiTurnEnv, extract_tag, registry

REPO = Path(__file__).resolve().parents[3]
PLUGIN_SRC = REPO / "tests" / "fixtures" / "freshper_demo_plugin"
#: ``make train``'s start (FrozenLake, seed 0): the folder name of the default text model. It
#: changes only when the built-in tasks' text or the tiny model's format does, and then every
#: cached pretraining is built again; update it then, on purpose.
DEFAULT_TEXT_MODEL = "tiny-text-s0-77b635c82475"


class DefaultsEnv(MultiTurnEnv):
    """The minimal contract and nothing else: ``format_reply``, ``sample_reply`` ... are the base class's."""

    def _reset_task(self, options):
        self.digit = int(self.np_random.integers(10))

    def instructions(self):
        return "Copy the digit shown: reply <answer>D</answer>."

    def state_text(self):
        return f"Digit: {self.digit}"

    def legal_actions(self):
        return list("0123456789")

    def parse_action(self, reply):
        digit = extract_tag(reply)
        return (int(digit), None) if digit in self.legal_actions() else (None, "answer one digit, 0-9")

    def apply_action(self, digit):
        return float(digit == self.digit), "", True, digit == self.digit


class BrokenStepEnv(DefaultsEnv):
    def apply_action(self, digit):
        raise RuntimeError("this task is under construction")


@pytest.fixture
def scratch_registry():
    tasks, gym_ids = dict(registry._TASKS), set(gym.registry)
    yield
    registry._TASKS.clear()
    registry._TASKS.update(tasks)
    for env_id in set(gym.registry) - gym_ids:
        del gym.registry[env_id]


def test_a_task_keeping_every_default_has_its_replies_in_its_tokenizers_text(scratch_registry, caplog) -> None:
    envs.register("aaa/Defaults-v0", DefaultsEnv, description="every default")
    with caplog.at_level(logging.INFO, logger="agents.policies.tiny"):
        modality, kwargs = tiny.task_model_args("aaa/Defaults-v0")
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    text = kwargs["task_text"]
    assert modality == "text" and "vocab_size" not in kwargs  # no text of its own: the shared vocabulary size
    replies = [line for line in text.splitlines() if line.startswith("<answer>") and line[8:9].isdigit()]
    assert len(replies) >= 8 and set(replies) <= {f"<answer>{d}</answer>" for d in range(10)}
    assert text.count("Digit: ") >= 12  # every episode's observations, not only the first one


def test_a_task_that_fails_while_its_episodes_are_sampled_says_so_in_a_warning(scratch_registry, caplog) -> None:
    envs.register("aaa/Broken-v0", BrokenStepEnv, description="raises in step")
    with caplog.at_level(logging.WARNING, logger="agents.policies.tiny"):
        parts = tiny.task_episodes("aaa/Broken-v0", random.Random(0))
    assert parts[0].startswith("user\nCopy the digit")
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "aaa/Broken-v0" in record.getMessage()
    assert "under construction" in record.getMessage()


def test_the_default_model_is_the_built_in_tasks_alone(scratch_registry) -> None:
    before = tiny.task_corpus()
    assert tiny.tiny_model_name("text") == DEFAULT_TEXT_MODEL
    # registered at run time (sorted before every built-in id, so it would draw from the shared random stream first)
    envs.register("aaa/Defaults-v0", DefaultsEnv, description="every default")
    assert tiny.task_corpus() == before
    assert tiny.tiny_model_name("text") == DEFAULT_TEXT_MODEL
    assert tiny.task_model_name("freshper/FrozenLake-v0", {"feedback": False}) == DEFAULT_TEXT_MODEL
    own = tiny.task_model_name("aaa/Defaults-v0")
    assert own.startswith("tiny-text-s0-") and own != DEFAULT_TEXT_MODEL


def test_installing_a_plugin_leaves_the_default_model_unchanged(tmp_path: Path) -> None:
    """A real installed plugin (an entry point of the ``freshper.envs`` group): ``make train``'s
    start model keeps its name; the plugin's task gets a tokenizer of its own that knows its replies."""
    src = tmp_path / "src"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                          "--disable-pip-version-check", "--quiet", "--target", str(target), str(src)],
                         capture_output=True, text=True, timeout=180)
    assert pip.returncode == 0, pip.stderr[-2000:]
    script = ("import envs\nfrom agents.policies import tiny\n"
              "assert 'demoplugin/GuessDigit-v0' in {s.id for s in envs.registered_tasks()}\n"
              "print(tiny.task_model_name('freshper/FrozenLake-v0', {'feedback': False}))\n"
              "print(tiny.task_model_name('demoplugin/GuessDigit-v0'))\n"
              "print('<answer>7</answer>' in tiny.task_model_args('demoplugin/GuessDigit-v0')[1]['task_text'])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lake, plugin, knows_replies = out.stdout.split()
    assert lake == DEFAULT_TEXT_MODEL
    assert plugin.startswith("tiny-text-s0-") and plugin != DEFAULT_TEXT_MODEL and knows_replies == "True"
