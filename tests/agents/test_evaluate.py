"""Evaluation: intervals, held-out seeds, the CLI's records and GIFs."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from agents.evaluate import main, wilson_interval  # noqa: E402
from agents.rollout.seeds import EVAL_SEED_BASE  # noqa: E402
from agents.record import load_records  # noqa: E402


def test_wilson_interval_is_sane_at_the_edges():
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and 0.1 < hi < 0.2
    lo, hi = wilson_interval(10, 20)
    assert lo < 0.5 < hi and abs((lo + hi) / 2 - 0.5) < 1e-9
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_wilson_interval_holds_the_observed_share_exactly():
    # 200 of 200 rounded to an upper end of 0.9999999999999999, below the share, and the run's
    # success plot (error bars of end - share) refused the negative bar at the end of a run
    for n in range(1, 1001):
        for k in (0, n // 2, n):
            lo, hi = wilson_interval(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n, lo, hi)
    assert wilson_interval(200, 200)[1] == 1.0 and wilson_interval(0, 1000)[0] == 0.0


def test_cli_on_image_task_saves_records_and_gifs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "eval"
    assert main(["--env", "freshper/FrozenLakeVision-v0", "--episodes", "3", "--max-new-tokens", "4",
                 "--save", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "success" in printed and "mean return" in printed
    records = load_records(out)
    assert len(records) == 3 and [r.seed for r in records] == [EVAL_SEED_BASE + i for i in range(3)]
    assert len(list((out / "gifs").glob("*.gif"))) == 3
