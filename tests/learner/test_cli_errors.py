"""What a user types wrong gets one clear message: an unknown task id, a typo'd flag (the nearest
flag named), JSON that does not parse (where it fails); and the evaluator's reply cap is train.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

import train
from agents import evaluate
from envs import play
from learner.config import make_config


def _error(capsys, argv: list[str], main=train.main) -> str:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    assert code == 2
    return capsys.readouterr().err


def test_an_unknown_task_id_is_one_line_naming_the_close_ones(tmp_path: Path, capsys) -> None:
    err = _error(capsys, ["--env-id", "freshper/FrozenLak-v0", "--runs-root", str(tmp_path)])
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: no task registered as 'freshper/FrozenLak-v0'") and "'freshper/FrozenLake-v0'" in err
    assert "--import" in err
    assert not list(tmp_path.iterdir())
    err = _error(capsys, ["--env", "freshper/FrozenLak-v0"], evaluate.main)
    assert err.count("\n") == 1 and "'freshper/FrozenLake-v0'" in err


def test_a_typod_flag_names_the_nearest_one_in_a_short_message(capsys) -> None:
    err = _error(capsys, ["--iteratons", "3", "--pretrian-steps=4"])
    assert "--iteratons (did you mean --iterations?)" in err and "--pretrian-steps (did you mean --pretrain-steps?)" in err
    assert len(err.splitlines()) <= 2 and "usage:" not in err
    err = _error(capsys, ["--env", "freshper/FrozenLake-v0", "--max-new-tokns", "4"], evaluate.main)
    assert "did you mean --max-new-tokens?" in err and len(err.splitlines()) <= 2
    err = _error(capsys, ["freshper/FrozenLake-v0", "--rnadom"], play.main)
    assert "did you mean --random?" in err


@pytest.mark.parametrize("text,column", [("{size:4}", 2), ('{"size": 4,}', 12), ("{'size': 4}", 2)])
def test_bad_json_says_where(capsys, text: str, column: int) -> None:
    err = _error(capsys, ["--env-kwargs", text])
    assert "invalid <lambda> value" not in err
    assert "argument --env-kwargs: not valid JSON: " in err and f"at character {column}" in err
    lines = err.splitlines()
    assert lines[1].strip() == text and lines[2].index("^") == lines[1].index(text) + column - 1
    assert ("JSON's keys and strings take double quotes" in err) == (column == 2)


def test_the_evaluators_reply_cap_is_train_pys(tmp_path: Path) -> None:
    assert evaluate.TRAIN_MAX_NEW_TOKENS == make_config().rollout.max_new_tokens
    assert evaluate.run_max_new_tokens(None) == evaluate.TRAIN_MAX_NEW_TOKENS
    model = tmp_path / "run" / "checkpoints" / "iter_000004" / "model"
    model.mkdir(parents=True)
    assert evaluate.run_max_new_tokens(str(model)) == evaluate.TRAIN_MAX_NEW_TOKENS
    (tmp_path / "run" / "config.yaml").write_text("env_id: freshper/FrozenLake-v0\nmax_new_tokens: 24\n")
    assert evaluate.run_max_new_tokens(str(model)) == 24
