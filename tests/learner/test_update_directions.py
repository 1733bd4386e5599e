"""learner/tools/update_directions.py: step sizes and the cosine between consecutive steps, on
hand-made checkpoints with known steps and on a real tiny run (trained with --adam-beta1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import learner.run
from learner.config import make_config
from learner.tools import update_directions
from learner.checkpoint import list_checkpoints

TINY = dict(tasks_per_iter=4, group_size=4, max_new_tokens=8, pretrain_steps=30, pretrain_batch=8, eval_every=0, eval_episodes=2,
            final_eval_episodes=2, progress=False, tensorboard=False, threads=1)


def _ckpt(root: Path, name: str, a: torch.Tensor, b: torch.Tensor) -> Path:
    (root / name / "model").mkdir(parents=True)
    save_file({"a": a.contiguous(), "b": b.contiguous(), "steps": torch.tensor([1], dtype=torch.int64)},
              str(root / name / "model" / "model.safetensors"))
    return root / name


def test_step_norms_and_cosines_are_those_of_the_weight_changes(tmp_path: Path) -> None:
    a0, b0 = torch.zeros(3), torch.ones(2)
    d = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])  # a step of norm 5
    ckpts = [_ckpt(tmp_path, "iter_000000", a0, b0),
             _ckpt(tmp_path, "iter_000001", a0 + d[0], b0 + d[1]),  # +d
             _ckpt(tmp_path, "iter_000002", a0 + 2 * d[0], b0 + 2 * d[1]),  # +d again: cosine +1
             _ckpt(tmp_path, "iter_000003", a0 + d[0], b0 + d[1]),  # -d: cosine -1
             _ckpt(tmp_path, "iter_000004", a0 + d[0] + torch.tensor([0.0, 2.0, 0.0]), b0 + d[1])]  # orthogonal: 0
    rows = update_directions.steps(ckpts)
    assert [r["norm"] for r in rows] == pytest.approx([5.0, 5.0, 5.0, 2.0])
    assert rows[0]["cos_prev"] is None
    assert [r["cos_prev"] for r in rows[1:]] == pytest.approx([1.0, -1.0, 0.0])
    assert rows[0]["top"][0] == ("b", pytest.approx(4.0))  # integer tensors are not weights


@pytest.mark.slow
def test_a_real_run_without_momentum_reads_back(tmp_path: Path, capsys) -> None:
    learner.run.train(make_config(runs_root=str(tmp_path), run_name="r", iterations=3, checkpoint_every=1, keep_checkpoints=5,
                             adam_beta1=0.0, **TINY))
    ckpts = list_checkpoints(tmp_path / "r" / "checkpoints")
    assert len(ckpts) == 4  # the start of RL and one per iteration
    saved = torch.load(ckpts[-1] / "trainer.pt", weights_only=True)
    assert all(tuple(g["betas"]) == (0.0, 0.999) for g in saved["optimizer"]["param_groups"])
    rows = update_directions.steps(ckpts)
    assert len(rows) == 3 and all(r["norm"] > 0 for r in rows)
    assert all(-1.0 <= r["cos_prev"] <= 1.0 for r in rows[1:])
    assert update_directions.main([str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "iter_000003" in out and "cos(prev)" in out
    with pytest.raises(SystemExit, match="two or more"):
        update_directions.main([str(tmp_path / "missing")])
