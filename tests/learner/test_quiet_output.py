"""What train.py prints: the run folder in one line (the settings are in its config.yaml), a warning
before a long pretraining that shows no progress, and a summary whose wall time counts the
start model's pretraining."""

from __future__ import annotations

import json
from pathlib import Path


import train
from learner.config import parse_config

REPO = Path(__file__).resolve().parents[2]


def test_a_long_pretraining_without_progress_bars_is_announced() -> None:
    cfg = parse_config(["--config", str(REPO / "configs" / "sokoban_simple.yaml"), "--pretrain-steps", "3",
                        "--no-progress"])
    warning = train.silent_pretraining(cfg)
    assert "3 steps (--pretrain-steps)" in warning and "a second stage of 400 steps (--pretrain-follow-steps)" in warning
    assert "no progress shown (--no-progress)" in warning
    assert "up to 1600 until" in train.silent_pretraining(parse_config(["--no-progress"]))  # the default's bar
    assert train.silent_pretraining(parse_config([])) == ""  # progress bars show it
    assert train.silent_pretraining(parse_config(["--no-progress", "--pretrain-steps", "8"])) == ""  # seconds


def test_the_run_prints_its_folder_in_a_line_and_the_summary_counts_the_pretraining(tmp_path: Path, capsys,
                                                                                     monkeypatch) -> None:
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    flags = ["--runs-root", str(tmp_path), "--run-name", "q", "--iterations", "1", "--tasks-per-iter", "2",
             "--group-size", "2", "--pretrain-steps", "3", "--pretrain-batch", "4", "--eval-every", "0",
             "--eval-episodes", "2", "--final-eval-episodes", "2", "--checkpoint-every", "0", "--no-progress",
             "--no-tensorboard", "--threads", "1"]
    assert train.main(flags) == 0
    out = capsys.readouterr().out
    assert f"run folder: {tmp_path / 'q'} (its settings: {tmp_path / 'q' / 'config.yaml'})" in out
    assert "kl_coef:" not in out and "kl_coef:" in (tmp_path / "q" / "config.yaml").read_text()
    summary = json.loads((tmp_path / "q" / "summary.json").read_text())
    [pre] = [json.loads(l) for l in (tmp_path / "q" / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["kind"] == "pretrain"]
    assert summary["wall_seconds"] > pre["pretrain_seconds"] + summary["rl_seconds"]
    assert f"; {pre['pretrain_seconds']:.0f} s of this session" in summary["text"]
    assert "wall time of this session" in summary["text"] and "pretraining included" in summary["text"]
