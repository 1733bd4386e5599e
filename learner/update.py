"""Optimizer steps: the IS-corrected GRPO update and the supervised (pretraining) step.

Both take records or samples through :mod:`learner.batch` (padding, masks, images, advantages
and weights, once) and micro-batch them with the whole batch's token count as the token-mean
denominator, so a micro-batched step equals a one-pass step.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from learner.batch import batch_logprobs, make_batches, supervised_batches
from learner.loss import LossConfig, LossStats, grpo_loss


def policy_update(policy, ref, optimizer, scheduler, trajs: Sequence, weights: Sequence[float] | np.ndarray,
                  ages: Sequence[float] | np.ndarray, *, loss_cfg: LossConfig, temperature: float = 1.0,
                  micro_batch: int = 256, max_grad_norm: float = 1.0, on_policy: bool,
                  skip_span: tuple[int, int] | None = None) -> dict[str, Any]:
    """One optimizer step of the GRPO loss on ``trajs`` (every sampled token carries its
    sample's advantage and its trajectory's PER weight and age).

    On the on-policy update the behaviour log-probs are the current ones, detached, so the
    ratio is exactly 1; the largest gap to the stored ones is logged (``behavior_logprob_gap``).
    ``ref`` is the KL reference policy (None when ``loss_cfg.kl_coef`` is 0). ``skip_span``:
    (open, close) token ids of spans left out of the loss (``--no-think-loss``).

    Returns statistics; ``skipped`` is 1 and ``nonfinite`` names the culprit when the loss or
    gradient was not finite (then no step is taken and the gradients are cleared).
    """
    batches = make_batches(trajs, weights, ages, micro_batch, skip_span)
    optimizer.zero_grad(set_to_none=True)
    if not batches:
        return {"skipped": 0.0, "tokens": 0.0}
    policy.model.train()
    stats, total_loss, gap, seq_tokens = LossStats(), 0.0, 0.0, 0
    for batch in batches:
        batch = batch.to(policy.device)
        logp = batch_logprobs(policy, batch, temperature)
        mu = batch.behavior_logprobs
        if on_policy:
            gap = max(gap, float(((logp.detach() - mu).abs() * batch.mask).max().item()))
            mu = logp.detach()
        ref_lp = None
        if loss_cfg.kl_coef != 0.0:
            with torch.no_grad():
                ref_lp = batch_logprobs(ref, batch, temperature)
        loss, st = grpo_loss(logp, mu, batch.mask, batch.advantages, batch.weights, loss_cfg, ref_lp, batch.ages,
                             num_tokens=batch.num_tokens)
        if not torch.isfinite(loss):
            optimizer.zero_grad(set_to_none=True)
            policy.model.eval()
            return {"skipped": 1.0, "nonfinite": "loss"}
        loss.backward()
        total_loss += float(loss.item())
        stats.merge(st)
        seq_tokens += batch.seq_tokens
    params = [p for p in policy.model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    policy.model.eval()
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": 1.0, "nonfinite": "grad"}
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if not all(bool(torch.isfinite(p).all()) for p in params):
        raise FloatingPointError("an update made the policy's weights not finite (the learning rate is far too high: "
                                 "lower --lr); the last checkpoint holds the weights before it")
    out: dict[str, Any] = stats.summary()
    drift = stats.drift_rate()
    if drift is not None:
        out["drift_per_step"] = drift
    clip_drift = stats.clip_drift_rate()
    if clip_drift is not None:
        out["clip_drift_per_step"] = clip_drift
    out.update(loss=total_loss, grad_norm=float(grad_norm), seq_tokens=float(seq_tokens), skipped=0.0,
               weight_mean=float(np.mean(weights)) if len(weights) else 1.0)
    if on_policy:
        out["behavior_logprob_gap"] = gap
    return out


def supervised_step(policy, optimizer, samples: Sequence, images: Sequence[Sequence[np.ndarray]] | None = None, *,
                    micro_batch: int = 256, max_grad_norm: float = 1.0) -> dict[str, float]:
    """One optimizer step on the mean negative log-likelihood of the samples' sampled (target)
    tokens; returns the loss and the gradient norm before clipping."""
    policy.model.train()
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for batch in supervised_batches(samples, images, micro_batch):
        loss = -batch_logprobs(policy, batch.to(policy.device)).sum() / batch.num_tokens
        loss.backward()
        total += float(loss.item())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.model.parameters(), max_grad_norm)
    optimizer.step()
    policy.model.eval()
    return {"loss": total, "grad_norm": float(grad_norm)}


@torch.no_grad()
def nll_per_sample(policy, samples: Sequence, images: Sequence[Sequence[np.ndarray]] | None = None,
                   micro_batch: int = 256) -> np.ndarray:
    """Mean negative log-likelihood per target token of each sample."""
    out: list[float] = []
    for batch in supervised_batches(samples, images, micro_batch):
        batch = batch.to(policy.device)
        lp = batch_logprobs(policy, batch)
        out.extend((-lp.sum(1) / batch.mask.sum(1).clamp(min=1)).tolist())
    return np.asarray(out)
