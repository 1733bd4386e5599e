"""The IS-corrected GRPO loss: gradients against hand-computed values and its invariants."""

from __future__ import annotations

import math

import pytest
import torch

from learner.loss import LossSettings, effective_sample_size, grpo_loss


def _leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_clipped_surrogate_gradient_matches_hand_computation() -> None:
    # Row 0: A=+1, tokens with rho = 1.1 (inside) and 1.5 (clipped above 1.2 -> no gradient).
    # Row 1: A=-2, tokens with rho = 0.5 (clipped below 0.8 -> no gradient), 2.0 (inside the dual
    # clip at 3 -> gradient), 4.0 (dual-clipped -> no gradient).
    mu = torch.zeros(2, 3, dtype=torch.float64)
    rho = [[1.1, 1.5, 1.0], [0.5, 2.0, 4.0]]
    logp = _leaf([[math.log(r) for r in row] for row in rho])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = grpo_loss(logp, mu, mask, adv, cfg=LossSettings(clip_low=0.2, clip_high=0.2, dual_clip=3.0))
    loss.backward()
    n = 5.0
    expected = torch.tensor([[-1.0 * 1.1 / n, 0.0, 0.0], [0.0, 2.0 * 2.0 / n, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)
    # Value: row0 -1.1 + -1.2 ; row1: max(1.0, 1.6)=1.6, 4.0, min(8, 6)=6.
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 1.6 + 4.0 + 6.0) / n)
    assert stats["clip_frac"] == pytest.approx(3 / 5)
    assert stats["ratio_max"] == pytest.approx(4.0) and stats["ratio_min"] == pytest.approx(0.5)


def test_truncated_is_gradient_matches_hand_computation() -> None:
    rho = [[0.5, 3.0]]
    logp = _leaf([[math.log(r) for r in row] for row in rho])
    loss, _ = grpo_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([2.0]), cfg=LossSettings(loss="tis", tis_cap=2.0))
    loss.backward()
    # d/dlogp of -sg(min(rho, C)) * A * logp = -min(rho, C) * A, token mean over 2.
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 * 2.0 / 2, -2.0 * 2.0 / 2]], dtype=torch.float64))


def test_sequence_ratio_uses_geometric_mean_of_the_row() -> None:
    logp = _leaf([[math.log(1.1), math.log(1.0 / 1.1)]])  # geometric mean ratio exactly 1
    loss, stats = grpo_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([1.0]), cfg=LossSettings(sequence_ratio=True))
    loss.backward()
    assert stats["ratio_mean"] == pytest.approx(1.0)
    # Each of the T=2 tokens has loss -A * rho_seq, token mean -> loss = -rho_seq;
    # d rho_seq / d logp_t = rho_seq / T, so the gradient is -1 * 1 / 2 on each token.
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -0.5, dtype=torch.float64))


def test_kl_k3_gradient_matches_hand_computation() -> None:
    logp = _leaf([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    loss, stats = grpo_loss(logp, logp.detach(), torch.ones(1, 1), torch.zeros(1), ref_logp=ref, cfg=LossSettings(kl_coef=0.5))
    loss.backward()
    d = math.log(0.25) - math.log(0.5)
    assert stats["kl"] == pytest.approx(math.exp(d) - d - 1)
    assert logp.grad.item() == pytest.approx(0.5 * (1 - math.exp(d)))


def test_per_weights_scale_each_trajectory_contribution() -> None:
    logp = _leaf([[-1.0, -2.0], [-0.5, -0.7]])
    mu = logp.detach() - 0.05
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -1.0])
    loss_w, _ = grpo_loss(logp, mu, mask, adv, weights=torch.tensor([0.25, 1.0]))
    loss_w.backward()
    grad_w = logp.grad.clone()
    logp.grad = None
    loss_1, _ = grpo_loss(logp, mu, mask, adv)
    loss_1.backward()
    torch.testing.assert_close(grad_w[0], 0.25 * logp.grad[0])
    torch.testing.assert_close(grad_w[1], logp.grad[1])


def test_all_equal_group_gives_zero_gradient() -> None:
    logp = _leaf([[-1.0, -2.0], [-0.3, -0.1]])
    loss, _ = grpo_loss(logp, logp.detach() + 0.1, torch.ones(2, 2), torch.zeros(2))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0


def test_ratio_is_exactly_one_against_detached_same_weights() -> None:
    logp = _leaf([[-1.234567, -0.000001, -7.5]])
    _, stats = grpo_loss(logp, logp.detach(), torch.ones(1, 3), torch.tensor([1.0]))
    assert stats["ratio_mean"] == 1.0 and stats["ratio_max"] == 1.0 and stats["ratio_min"] == 1.0
    assert stats["clip_frac"] == 0.0 and stats["ess"] == 1.0


def test_micro_batches_with_shared_denominator_sum_to_the_whole() -> None:
    torch.manual_seed(0)
    logp = _leaf(torch.randn(4, 3).tolist())
    mu = logp.detach() + 0.1 * torch.randn(4, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    adv = torch.tensor([0.5, -1.0, 2.0, -0.3])
    whole, _ = grpo_loss(logp, mu, mask, adv)
    n = float(mask.sum())
    parts = sum(grpo_loss(logp[i : i + 2], mu[i : i + 2], mask[i : i + 2], adv[i : i + 2], num_tokens=n)[0] for i in (0, 2))
    assert parts.item() == pytest.approx(whole.item())


def test_ess_per_age_bucket() -> None:
    logp = _leaf([[0.0, 0.0], [math.log(2.0), 0.0]])
    _, stats = grpo_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2), ages=torch.tensor([0, 5]))
    assert stats["ess/age_0"] == 1.0
    assert stats["ess/age_3-8"] == pytest.approx(effective_sample_size(torch.tensor([2.0, 1.0])))
    assert effective_sample_size(torch.tensor([2.0, 1.0])) == pytest.approx(9 / 5 / 2)


def test_kl_without_reference_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1), cfg=LossSettings(kl_coef=0.1))
