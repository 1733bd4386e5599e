"""Optimizer steps: the IS-corrected GRPO update and the supervised (pretraining) step.

Both take records or samples through :mod:`learner.batch` (padding, masks, images, advantages
and weights, once) and micro-batch them with the whole batch's token count as the token-mean
denominator, so a micro-batched step equals a one-pass step.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from learner.batch import batch_logprobs, make_batches, pad_rows, supervised_batches
from learner.loss import LossSettings, LossStats, grpo_loss


class AdapterReference:
    """The KL reference of a LoRA policy: the same model with its adapters switched off, so the
    reference costs no second copy of the weights."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def reference_logprobs(self, batch, temperature: float) -> torch.Tensor:
        from agents.policies.lora import adapters_disabled

        with adapters_disabled(self.policy.model):
            return batch_logprobs(self.policy, batch, temperature)


def reference_logprobs(ref, batch, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probs of the batch's sampled tokens under the KL reference (no gradient):
    a frozen :class:`~agents.policies.policy.Policy`, or an object with ``reference_logprobs``
    (:class:`AdapterReference`)."""
    with torch.no_grad():
        if hasattr(ref, "reference_logprobs"):
            return ref.reference_logprobs(batch, temperature)
        return batch_logprobs(ref, batch, temperature)


def reference_key(policy, temperature: float) -> str:
    """What a sample's kept reference log-probs are tied to (:attr:`agents.record.Sample.reference_key`):
    the sampling temperature and the compute precision. The reference itself is the run's own
    and never changes within it."""
    return f"temperature={float(temperature)!r};compute={str(policy.compute_dtype).removeprefix('torch.')}"


def kept_reference(batch, key: str) -> torch.Tensor | None:
    """``[B, T]`` reference log-probs the batch's samples keep under ``key``; None unless every
    one keeps them."""
    rows = [s.reference_logprobs for s in batch.samples]
    if not rows or any(r is None for r in rows) or any(s.reference_key != key for s in batch.samples):
        return None
    return pad_rows(rows, batch.mask.shape[1]).to(batch.mask.device)


def keep_reference(batch, ref_lp: torch.Tensor, key: str) -> None:
    """Store each sample's reference log-probs (``ref_lp``'s row, on its sampled tokens)."""
    rows = ref_lp.detach().float().cpu().numpy()
    for b, sample in enumerate(batch.samples):
        n = len(sample.token_ids)
        sample.reference_logprobs = np.where(sample.loss_mask > 0, rows[b, :n], 0.0).astype(np.float32)
        sample.reference_key = key


def weights_finite(params) -> bool:
    """Whether every weight is finite, from one fused norm per tensor (a sharded tensor: its
    local shard, each rank checks its own)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    local = [p for p in local if p.numel()]
    if not local:
        return True
    norms = torch._foreach_norm([p.detach() for p in local])
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())


def stepped(stats: dict[str, Any]) -> bool:
    """Whether an update's statistics say the optimizer took its step."""
    return not stats.get("skipped") and not stats.get("fp16_overflow")


def policy_update(policy, ref, optimizer, scheduler, trajs: Sequence, weights: Sequence[float] | np.ndarray,
                  ages: Sequence[float] | np.ndarray, *, loss_cfg: LossSettings, temperature: float = 1.0,
                  micro_batch: int = 256, max_grad_norm: float = 1.0, on_policy: bool,
                  skip_span: tuple[int, int] | None = None, scaler=None, shard=None, observe=None,
                  keep_reference_logprobs: bool = False) -> dict[str, Any]:
    """One optimizer step of the GRPO loss on ``trajs`` (every sampled token carries its
    sample's advantage and its trajectory's PER weight and age).

    On the on-policy update the behaviour log-probs are the current ones, detached, so the
    ratio is exactly 1; the largest gap to the stored ones is logged (``behavior_logprob_gap``).
    ``ref`` is the KL reference (None when ``loss_cfg.kl_coef`` is 0; see
    :func:`reference_logprobs`). ``skip_span``: (open, close) token ids of spans left out of the
    loss (``--no-think-loss``). ``scaler``: a ``torch.amp.GradScaler`` for fp16 compute (an
    overflowing step is skipped and the loss scale lowered, counted in ``fp16_overflow``, not
    as a non-finite update). ``shard``: in a sharded learner (:mod:`learner.distributed`), this
    rank's part of the batch and the reductions across ranks; None in one process.
    ``observe``: called as ``observe(batch, logp, behavior_logp)`` with each micro-batch's
    detached log-probs before the step (the replay log reads the replay-time IS ratios there);
    it changes nothing. ``keep_reference_logprobs``: the samples keep the reference's log-probs
    the first time they are scored (:attr:`agents.record.Sample.reference_logprobs`), and a later
    update of them (a replay update) reads them instead of running the reference again; only for
    a reference that never changes (a run's), and not in a sharded learner.

    Returns statistics; ``skipped`` is 1 and ``nonfinite`` names the culprit when the loss or
    gradient was not finite (then no step is taken and the gradients are cleared).
    """
    batches = make_batches(trajs, weights, ages, micro_batch, skip_span, part=None if shard is None else shard.part)
    if shard is not None:
        batches = shard.select(batches, lambda: make_batches(trajs, weights, ages, 1, skip_span)[0])
    optimizer.zero_grad(set_to_none=True)
    if not batches and shard is None:
        return {"skipped": 0.0, "tokens": 0.0}
    policy.model.train()
    # a sharded learner's ranks must all run the reference, so only one process keeps it
    key = reference_key(policy, temperature) if keep_reference_logprobs and shard is None else None
    stats, total_loss, gap, seq_tokens, finite = LossStats(), 0.0, 0.0, 0, True
    for batch in batches:
        batch = batch.to(policy.device)
        logp = batch_logprobs(policy, batch, temperature)
        mu = batch.behavior_logprobs
        if on_policy:
            gap = max(gap, float(((logp.detach() - mu).abs() * batch.mask).max().item()))
            mu = logp.detach()
        if observe is not None:
            observe(batch, logp.detach(), mu)
        ref_lp = None
        if loss_cfg.kl_coef != 0.0:
            ref_lp = kept_reference(batch, key) if key is not None else None
            if ref_lp is None:
                ref_lp = reference_logprobs(ref, batch, temperature)
                if key is not None:
                    keep_reference(batch, ref_lp, key)
        loss, st = grpo_loss(logp, mu, batch.mask, batch.advantages, batch.weights, loss_cfg, ref_lp, batch.ages,
                             num_tokens=batch.num_tokens)
        if not torch.isfinite(loss):
            finite = False
            if shard is None:
                break
            loss = loss.nan_to_num(0.0, 0.0, 0.0) * 0.0  # every rank must take part in the backward
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total_loss += float(loss.item())
        stats.merge(st)
        seq_tokens += batch.seq_tokens
    if shard is not None:
        finite = shard.all_finite(finite)
        total_loss, gap, seq_tokens = shard.reduce_scalars(total_loss, gap, seq_tokens)
        stats = shard.reduce_stats(stats)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        policy.model.eval()
        return {"skipped": 1.0, "nonfinite": "loss"}
    params = [p for p in policy.model.parameters() if p.requires_grad]
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor (sharded parameters): the global norm
        grad_norm = grad_norm.full_tensor()
    policy.model.eval()
    if not torch.isfinite(grad_norm):
        if scaler is not None:  # an fp16 overflow: the scaler skips the step and lowers its scale
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            return {"skipped": 0.0, "fp16_overflow": 1.0, "loss": total_loss}
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": 1.0, "nonfinite": "grad"}
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    if not weights_finite(params):
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
