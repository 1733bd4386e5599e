"""The tasks install without the trainer: in a clean virtual environment holding freshper's core
dependencies only (no torch, no transformers), every task imports and plays, a task is served
and played remotely, and ``python -m envs new`` writes a plugin package that passes its own test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

PLAY_EVERY_TASK = r"""
import importlib.util, sys, threading
import numpy as np
import gymnasium as gym
import envs
from envs.serve import make_server

assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("transformers") is None
played = []
for spec in envs.registered_tasks():
    if not spec.available or spec.needs:
        continue
    env = gym.make(spec.id)
    obs, info = env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        obs, reward, terminated, truncated, info = env.step(env.unwrapped.sample_reply(rng))
        if terminated or truncated:
            break
    env.close()
    played.append(spec.id)
server = make_server("freshper/FrozenLakeVision-v0")
threading.Thread(target=server.serve_forever, daemon=True).start()
remote = gym.make("freshper/RemoteVision-v0", url=server.url)
local = gym.make("freshper/FrozenLakeVision-v0")
assert np.array_equal(remote.reset(seed=3)[0]["image"], local.reset(seed=3)[0]["image"])
remote.close()
server.shutdown()
print("PLAYED", " ".join(played))
print("MODULES", " ".join(sorted(m for m in ("torch", "transformers", "agents", "learner") if m in sys.modules)))
"""


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def core_venv(tmp_path_factory) -> Path:
    """A fresh venv with freshper installed from a copy of this checkout, core dependencies only."""
    root = tmp_path_factory.mktemp("core")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "train.py"):
        shutil.copy2(REPO / name, src / name)
    for package in ("envs", "agents", "replay", "learner"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv.create(root / "venv", with_pip=True, clear=True)
    py = root / "venv" / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(src)], root)
    return py


def test_every_task_plays_with_the_core_dependencies_only(core_venv: Path, tmp_path: Path) -> None:
    out = _run([str(core_venv), "-c", PLAY_EVERY_TASK], tmp_path).stdout
    played = out.split("PLAYED", 1)[1].split("\n", 1)[0].split()
    assert {"freshper/FrozenLake-v0", "freshper/FrozenLakeVision-v0", "freshper/Sokoban-v0",
            "freshper/SokobanVision-v0", "freshper/SearchQA-v0"} <= set(played)
    assert out.split("MODULES", 1)[1].split() == []  # nothing of the trainer was imported


def test_the_scaffolded_plugin_passes_its_own_test_from_a_clean_venv(core_venv: Path, tmp_path: Path) -> None:
    pkg = tmp_path / "plugin"
    out = _run([str(core_venv), "-m", "envs", "new", "mypkg/MyTask-v0", str(pkg)], tmp_path).stdout
    assert "wrote mypkg/MyTask-v0" in out
    assert {p.relative_to(pkg).as_posix() for p in pkg.rglob("*") if p.is_file()} == {
        "pyproject.toml", "README.md", "mypkg/__init__.py", "mypkg/tasks.py", "tests/test_task.py"}
    _run([str(core_venv), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
          "-e", str(pkg)], tmp_path)
    _run([str(core_venv), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "pytest>=8"], tmp_path)
    listing = _run([str(core_venv), "-m", "envs", "list"], tmp_path).stdout
    assert "mypkg/MyTask-v0" in listing and "mypkg" in listing.split("mypkg/MyTask-v0", 1)[1].split("\n")[0]
    result = _run([str(core_venv), "-m", "pytest", "-q", "-p", "no:cacheprovider"], pkg)
    assert "3 passed" in result.stdout
    # a second scaffold into the same folder is refused, not overwritten
    again = subprocess.run([str(core_venv), "-m", "envs", "new", "mypkg/MyTask-v0", str(pkg)], cwd=tmp_path,
                           capture_output=True, text=True)
    assert again.returncode == 2 and "not empty" in again.stderr


def test_the_scaffolded_plugin_trains_and_evaluates_from_the_embedded_default(tmp_path: Path) -> None:
    """The package ``python -m envs new`` writes, installed as a user would (pip, its entry point
    found by the registry, nothing imported by hand), trains a few iterations from the embedded
    default and evaluates, through train.py."""
    pkg, site = tmp_path / "plugin", tmp_path / "site"
    _run([sys.executable, "-m", "envs", "new", "mypkg/MyTask-v0", str(pkg)], tmp_path)
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
          "--target", str(site), str(pkg)], tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "OMP_WAIT_POLICY": "PASSIVE",
           "FRESHPER_CACHE": str(tmp_path / "cache")}
    listing = subprocess.run([sys.executable, "-m", "envs", "list"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
    assert "mypkg/MyTask-v0" in listing.stdout, listing.stdout + listing.stderr
    flags = ["--env-id", "mypkg/MyTask-v0", "--runs-root", str(tmp_path / "runs"), "--run-name", "mine",
             "--iterations", "2", "--tasks-per-iter", "2", "--group-size", "2", "--max-new-tokens", "8",
             "--pretrain-steps", "4", "--pretrain-batch", "4", "--eval-every", "0", "--eval-episodes", "2",
             "--final-eval-episodes", "4", "--checkpoint-every", "0", "--no-progress", "--no-tensorboard",
             "--threads", "1"]
    out = subprocess.run([sys.executable, str(REPO / "train.py"), *flags], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "mine" / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["episodes"] == 8
    assert summary["evals"]["final"]["episodes_eval"] == 4 and summary["evals"]["baseline"]["episodes_eval"] == 4
