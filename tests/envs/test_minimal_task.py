"""docs/hub.md's minimal task is real: the page shows docs/examples/minimal_task.py as it is (30
lines at most), the task passes gymnasium's checker and its random agent plays it, and the file
run as the page says plays it and has train.py train and evaluate it (tiny settings). It
offers no optional capability (envs/capabilities.py): every default holds, and a reasoning mode
that needs one is refused when a run starts, with the modes it can train with.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
import envs.play
from envs import capabilities
from envs.cli import import_tasks

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "minimal_task.py"
TASK = "examples/CopyDigit-v0"


@pytest.fixture
def task_class(monkeypatch: pytest.MonkeyPatch):
    """Import the example as ``--import docs/examples/minimal_task.py`` does (it registers its task);
    the registry, ``sys.path`` and ``sys.modules`` are left as they ship."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    import_tasks([str(EXAMPLE)])
    try:
        yield envs.task_class(TASK)
    finally:
        envs.unregister(TASK)
        sys.modules.pop(EXAMPLE.stem, None)


def test_the_hub_page_shows_the_whole_file_and_it_is_short() -> None:
    code = EXAMPLE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "hub.md").read_text(encoding="utf-8"), re.S)
    assert code in blocks, "docs/hub.md's minimal task differs from docs/examples/minimal_task.py"
    assert len(code.splitlines()) <= 30


def test_it_passes_the_checker_plays_and_every_optional_capability_has_its_default(task_class) -> None:
    env = envs.make(TASK, render_mode="ansi")
    check_env(env.unwrapped)
    summary = envs.play.play(TASK, seed=0, random_agent=True, auto=True, stdout=io.StringIO())
    assert summary.turns == 1 and summary.invalid_replies == 0 and summary.episode_return in (0.0, 1.0)
    task = env.unwrapped
    task.reset(seed=3)
    assert not [c.__name__ for c in capabilities.CAPABILITIES if isinstance(task, c) or isinstance(task_class, c)]
    assert capabilities.outcome_text(task, False, False) == task.render_text() == f"Digit: {task.digit}"
    assert (capabilities.outcome_text(task, True, True), capabilities.outcome_text(task, True, False)) == ("success", "failure")
    assert capabilities.tokenizer_text(task) == ""
    assert capabilities.counterfactual_probes(task, np.random.default_rng(0), 4) == []
    assert capabilities.turn_diagnostics(task_class, [("Digit: 3", "<answer>3</answer>")]) == {}
    assert [m for m in capabilities.REASONINGS if capabilities.supports_reasoning(task_class, m)] == ["none", "state"]
    assert capabilities.reasoning_text(task, "state") == f"Digit: {task.digit}"
    with pytest.raises(capabilities.MissingCapability, match=r"CopyDigitEnv does not implement lookahead_text\(\)"):
        capabilities.reasoning_text(task, "lookahead")
    env.close()


def test_the_file_plays_then_train_py_trains_and_evaluates_it(tmp_path: Path) -> None:
    flags = ["--runs-root", str(tmp_path / "runs"), "--run-name", "copy", "--iterations", "2", "--tasks-per-iter", "2",
             "--group-size", "2", "--max-new-tokens", "8", "--pretrain-steps", "4", "--pretrain-batch", "4",
             "--eval-every", "0", "--eval-episodes", "2", "--final-eval-episodes", "4", "--checkpoint-every", "0",
             "--no-progress", "--no-tensorboard", "--threads", "1"]
    env = {**os.environ, "FRESHPER_CACHE": str(tmp_path / "cache"), "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, str(EXAMPLE), *flags], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Playing examples/CopyDigit-v0 (seed 0)" in out.stdout and "The episode is over." in out.stdout
    summary = json.loads((tmp_path / "runs" / "copy" / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["episodes"] == 8
    assert summary["evals"]["final"]["episodes_eval"] == 4 and summary["evals"]["baseline"]["episodes_eval"] == 4
    rows = [json.loads(line) for line in (tmp_path / "runs" / "copy" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows].count("train") == 2 and [r["kind"] for r in rows].count("pretrain") == 1


def test_a_reasoning_mode_it_cannot_write_is_refused_at_the_start_of_a_run(task_class, tmp_path: Path) -> None:
    import learner.run
    from learner.config import make_config

    cfg = make_config(runs_root=str(tmp_path), run_name="look", env_id=TASK, reasoning="lookahead", iterations=1)
    with pytest.raises(ValueError, match=r"--reasoning lookahead: CopyDigitEnv does not implement lookahead_text\(\) "
                                         r"\(envs.capabilities.Lookahead\); train it with --reasoning none\|state"):
        learner.run.train(cfg)
    assert not (tmp_path / "look").exists()
