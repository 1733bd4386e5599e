"""``--tau auto``: the drift estimate, the controller's direction, an exact re-keying of the buffer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.autotau import TauController
from learner.loss import LossStats
from replay import ReplayBuffer


def _lognormal_ratios(n: int, sigma2: float, rng: np.random.Generator) -> np.ndarray:
    """Ratios with E[rho] = 1 whose normalised ESS is exp(-sigma^2)."""
    return np.exp(rng.normal(-sigma2 / 2, math.sqrt(sigma2), n))


@pytest.mark.parametrize("c", [0.01, 0.05])
def test_drift_rate_recovers_the_decay_of_the_ess_with_age(c: float) -> None:
    rng = np.random.default_rng(0)
    stats = LossStats()
    for age in (1, 2, 4, 6, 12, 20):
        rho = _lognormal_ratios(40_000, c * age, rng)
        stats.add_ratios(torch.as_tensor(rho), torch.full((len(rho),), float(age)))
    assert stats.drift_rate() == pytest.approx(c, rel=0.1)
    fresh = LossStats()
    fresh.add_ratios(torch.ones(10), torch.zeros(10))
    assert fresh.drift_rate() is None  # no token older than 0: nothing to fit


def test_a_faster_drifting_policy_gets_a_shorter_memory() -> None:
    slow, fast = TauController(alpha=1.0, target_ess=0.9), TauController(alpha=1.0, target_ess=0.9)
    for _ in range(50):
        slow.observe(0.005)
        fast.observe(0.05)
    assert fast.tau < slow.tau
    assert slow.tau == pytest.approx((1 / 0.9 - 1) / 0.005, rel=0.02)
    # the expected replayed-token ESS under exponential ages, 1 / (1 + c tau / alpha), is the target
    assert 1 / (1 + 0.05 * fast.tau) == pytest.approx(0.9, rel=0.01)
    before = slow.tau
    assert not slow.observe(None) and slow.tau == before


@pytest.mark.parametrize("q", [0.002, 0.01])
def test_clip_drift_rate_recovers_how_fast_tokens_leave_the_clip_range(q: float) -> None:
    """Tokens of age a lie outside [0.8, 1.2] with probability q a: the fit gives q back, and
    the per-bucket shares are logged."""
    rng = np.random.default_rng(2)
    stats = LossStats()
    for age in (1, 2, 4, 6, 12, 20):
        n = 40_000
        outside = rng.random(n) < q * age
        rho = np.where(outside, rng.choice([0.5, 1.5], n), rng.uniform(0.9, 1.1, n))
        stats.add_ratios(torch.as_tensor(rho), torch.full((n,), float(age)), clip=(0.2, 0.2))
    assert stats.clip_drift_rate() == pytest.approx(q, rel=0.05)
    summary = stats.summary()
    assert summary["clip_out/age_1-2"] == pytest.approx(q * 1.5, rel=0.1)
    assert summary["clip_out/age_9+"] == pytest.approx(q * 16, rel=0.1)
    fresh = LossStats()
    fresh.add_ratios(torch.full((10,), 2.0), torch.zeros(10), clip=(0.2, 0.2))
    assert fresh.clip_drift_rate() is None  # no token older than 0: nothing to fit


def test_the_clip_signal_keeps_the_expected_clipped_share_at_its_target() -> None:
    slow = TauController(alpha=1.0, signal="clip", target_clip=0.05)
    fast = TauController(alpha=1.0, signal="clip", target_clip=0.05)
    assert slow.metric == "clip_drift_per_step" and TauController().metric == "drift_per_step"
    for _ in range(60):
        slow.observe(0.0005)
        fast.observe(0.005)
    assert fast.tau < slow.tau
    # expected share under exponential ages of mean tau / alpha: q tau / alpha = the target
    assert 0.005 * fast.tau == pytest.approx(0.05, rel=0.02)
    assert 0.0005 * slow.tau == pytest.approx(0.05, rel=0.02)
    with pytest.raises(ValueError):
        TauController(signal="kl")


def test_set_tau_samples_exactly_like_a_buffer_built_with_that_tau() -> None:
    rng = np.random.default_rng(1)
    a = ReplayBuffer(50, mode="fresh", alpha=0.7, tau=10.0, seed=0)
    b = ReplayBuffer(50, mode="fresh", alpha=0.7, tau=3.0, seed=0)
    for step in range(12):
        items, p = list(range(step * 5, step * 5 + 5)), rng.random(5) + 0.01
        a.add(items, p, step=step)
        b.add(items, p, step=step)
    a.set_tau(3.0)
    pa, pb = a.probabilities(12), b.probabilities(12)
    np.testing.assert_allclose(pa[1], pb[1], rtol=1e-12)
    np.testing.assert_array_equal(pa[0], pb[0])
    with pytest.raises(ValueError):
        a.set_tau(0.0)


def test_train_with_tau_auto_moves_tau_and_resumes(tmp_path) -> None:
    import learner.run
    from learner.config import make_config, parse_config, with_settings
    from learner.report import read_metrics

    cfg = make_config(runs_root=str(tmp_path), run_name="auto", env_id="freshper/FrozenLake-v0", tasks_per_iter=2,
                       group_size=4, max_new_tokens=6, pretrain_steps=10, pretrain_batch=16, pretrain_lr=3e-3,
                       iterations=4, replay="fresh", tau="auto", replay_batch=8, eval_every=0, final_eval_episodes=2,
                       eval_both=False, checkpoint_every=2, progress=False, tensorboard=False, threads=1, lr=3e-3)
    learner.run.train(cfg)
    rows = [r for r in read_metrics(tmp_path / "auto" / "metrics.jsonl") if r["kind"] == "train"]
    assert all("tau" in r for r in rows) and rows[-1]["tau"] != 10.0
    assert any("drift_per_step" in r or "replay_drift_per_step" in r for r in rows)
    assert parse_config(["--tau", "auto", "--replay", "fresh"]).replay.tau == "auto"
    assert any(k.endswith("clip_out/age_1-2") for r in rows for k in r)
    # the clip signal: tau follows the clipped share, and a resume keeps the controller's state
    clip = with_settings(cfg, run_name="clip", tau_signal="clip", tau_target_clip=0.02, iterations=2)
    learner.run.train(clip)
    learner.run.train(parse_config(["--resume", str(tmp_path / "clip"), "--iterations", "4"]))
    rows = [r for r in read_metrics(tmp_path / "clip" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert any("clip_drift_per_step" in r or "replay_clip_drift_per_step" in r for r in rows)
    assert rows[-1]["tau"] != 10.0
    with pytest.raises(ValueError, match="--tau-signal"):
        parse_config(["--tau", "auto", "--replay", "fresh", "--tau-signal", "kl"])
    with pytest.raises(ValueError, match="--tau auto needs --replay fresh"):
        parse_config(["--tau", "auto", "--replay", "none"])
