"""learner/tools/buffer_drift.py on real tiny runs: a policy that has not moved scores its buffer's
tokens exactly as they were sampled (KL 0, ESS 1); one trained at a large learning rate does not."""

from __future__ import annotations

from pathlib import Path

import pytest

import learner.run
from learner.config import make_config
from learner.tools import buffer_drift

TINY = dict(tasks_per_iter=4, group_size=4, max_new_tokens=8, pretrain_steps=30, pretrain_batch=8, eval_every=0, eval_episodes=2,
            final_eval_episodes=2, progress=False, tensorboard=False, threads=1, eval_both=False, diagnostics=False,
            iterations=4, replay="fresh", replay_batch=8, replay_ratio=1, buffer_capacity=64, checkpoint_every=4,
            kl_coef=0.0)


@pytest.mark.slow
def test_buffer_drift_is_zero_for_an_unmoved_policy_and_grows_with_the_learning_rate(tmp_path: Path, capsys) -> None:
    learner.run.train(make_config(runs_root=str(tmp_path), run_name="still", lr=1e-12, **TINY))
    learner.run.train(make_config(runs_root=str(tmp_path), run_name="moved", lr=1e-2, **TINY))
    still = buffer_drift.drift(buffer_drift.checkpoint_of(tmp_path / "still"), per_bucket=100, seed=0, micro_batch=64)
    # 4 iterations x 16 episodes, 2 optimizer steps per iteration, all kept: ages 2, 4, 6 and 8
    assert sum(r["trajectories"] for r in still) == 64
    assert [r["bucket"] for r in still] == ["0-3", "4-7", "8-15"]
    assert all(r["tokens"] > 0 for r in still)
    assert all(abs(r["kl"]) < 1e-4 and r["ess"] > 0.9999 and r["outside_clip"] == 0.0 for r in still)
    moved = buffer_drift.drift(buffer_drift.checkpoint_of(tmp_path / "moved"), per_bucket=100, seed=0, micro_batch=64)
    assert max(r["kl"] for r in moved) > 1e-3 and min(r["ess"] for r in moved) < 0.999
    assert buffer_drift.main([str(tmp_path / "moved"), "--per-bucket", "2", "--by-setting", "--plot",
                              str(tmp_path / "d.png"), "--json", str(tmp_path / "d.jsonl")]) == 0
    assert (tmp_path / "d.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "moved/checkpoints/iter_000004" in out and "outside clip" in out
    summary = out.split("setting ")[1].split("plot: ")[0].strip().splitlines()[1:]
    assert len(summary) == 3 and all(line.split()[:3] == ["moved", b, "1"] for line, b in zip(summary, ("0-3", "4-7", "8-15")))
    # the same tables again from the written rows, without scoring anything
    assert buffer_drift.main(["--rows", str(tmp_path / "d.jsonl"), "--by-setting"]) == 0
    assert capsys.readouterr().out.split("setting ")[1].strip().splitlines()[1:] == summary
    assert buffer_drift.setting_of("runs/x/fresh_tau2_s13/checkpoints/iter_000100") == "fresh_tau2"
    with pytest.raises(SystemExit, match="neither a checkpoint"):
        buffer_drift.main([str(tmp_path / "missing")])
