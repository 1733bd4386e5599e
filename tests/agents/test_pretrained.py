"""Real checkpoints without a hub (agents/pretrained.py): what ``--model`` accepts and the
clear errors; the conversion of the real SmolLM2 GGUF runs in ``make test-real``
(tests/agents/test_real_model.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agents.pretrained import KNOWN_MODELS, resolve_model

REPO = Path(__file__).resolve().parents[2]


def test_a_folder_or_a_hub_id_passes_through_and_a_missing_gguf_is_a_clear_error(tmp_path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_the_cli_lists_the_known_models_and_refuses_an_unknown_one_in_one_line(tmp_path) -> None:
    env = {"FRESHPER_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "agents.pretrained", "list"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in KNOWN_MODELS:
        assert name in out.stdout and "not converted yet" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "agents.pretrained", "pull", "gpt-17"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown model 'gpt-17'" in bad.stderr


def test_the_module_is_the_projects_own_from_any_folder(tmp_path) -> None:
    """Another installed package (openai-agents, a dependency of verifiers) also has a top-level
    ``agents``; run from outside the repository, its modules win where names collide. This
    module's name must not be one of them."""
    out = subprocess.run([sys.executable, "-c", "import agents.pretrained as m; print(m.__file__)"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).resolve() == REPO / "agents" / "pretrained.py"
