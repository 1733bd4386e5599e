"""The IS-corrected GRPO loss on padded token tensors (pure torch, no model).

Rows are training sequences (one per turn in ``window:k`` mode); every sampled token of a row
carries its trajectory's stored advantage and PER weight. With ``rho_t = exp(logp_t - mu_t)``:

- ``clip`` (default): ``-min(rho A, clip(rho, 1-lo, 1+hi) A)``, and for ``A < 0`` the dual clip
  ``min(that, -c A)`` (Ye et al., 2020) so a huge ratio on a bad action cannot blow up the loss;
- ``tis``: truncated importance sampling ``-sg(min(rho, C)) A logp``;
- ``sequence_ratio``: ``rho`` is the row's geometric-mean ratio ``exp(mean_t log rho_t)``
  (one ratio per sequence, GSPO-style) instead of one per token.

Aggregation is the token mean over the whole batch: ``sum_i w_i sum_t l_it / sum_i T_i``, so a
trajectory's PER weight scales exactly its own contribution. The optional KL to a reference
policy uses the non-negative k3 estimator ``exp(r - logp) - (r - logp) - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import math

import torch

#: Age buckets (optimizer steps since collection) for the IS effective-sample-size stats.
AGE_BUCKETS: tuple[tuple[int, float], ...] = ((0, 0), (1, 2), (3, 8), (9, float("inf")))


def age_bucket_name(lo: int, hi: float) -> str:
    """``"0"``, ``"1-2"``, ``"9+"``: the metric suffix of an age bucket."""
    if hi == lo:
        return str(lo)
    return f"{lo}+" if hi == float("inf") else f"{lo}-{int(hi)}"


@dataclass
class LossSettings:
    """The knobs of :func:`grpo_loss`: ``train.py``'s ``loss`` settings (``learner.config``)."""

    loss: str = "clip"
    """'clip': clipped surrogate with dual clip; 'tis': truncated importance sampling"""
    clip_low: float = 0.2
    """lower clip: ratios below 1 - clip_low are clipped"""
    clip_high: float = 0.2
    """upper clip: ratios above 1 + clip_high are clipped"""
    dual_clip: float | None = 3.0
    """dual-clip constant c for negative advantages (none, or <= 1: off)"""
    tis_cap: float = 2.0
    """truncation C of the 'tis' loss"""
    sequence_ratio: bool = False
    """use one (geometric-mean) ratio per sequence instead of per token"""
    kl_coef: float = 0.0
    """weight of the k3 KL to the reference policy (the policy RL starts from); 0: off"""

    def __post_init__(self) -> None:
        if self.loss not in ("clip", "tis"):
            raise ValueError(f"--loss must be clip|tis, got {self.loss!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("--clip-low and --clip-high must be >= 0")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"--kl-coef must be a number >= 0, got {self.kl_coef}")


def grpo_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | None = None,
    cfg: LossSettings | None = None,
    ref_logp: torch.Tensor | None = None,
    ages: torch.Tensor | None = None,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, "LossStats"]:
    """Loss and statistics for one batch of rows.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (with grad).
        behavior_logp: ``[B, T]`` log-probs stored at sampling time (no grad).
        mask: ``[B, T]`` 1 on sampled tokens, 0 on prompt, environment and padding tokens.
        advantages: ``[B]`` the stored group-relative advantage of each row's trajectory.
        weights: ``[B]`` PER importance weights (1 for fresh data); default all ones.
        cfg: loss settings; default :class:`LossSettings`.
        ref_logp: ``[B, T]`` reference-policy log-probs for the KL term (needed if ``kl_coef``).
        ages: ``[B]`` optimizer steps since each row was collected (for per-age ESS stats).
        num_tokens: the token-mean denominator; default ``mask.sum()``. Pass the whole batch's
            count when a batch is split into micro-batches, so the sum of parts equals the whole.

    Returns:
        ``(loss, stats)``: a scalar to minimise and its :class:`LossStats` (ratio mean/max/min,
        clip fraction, KL, and ``ess/age_<bucket>``: normalised IS effective sample size
        ``(sum rho)^2 / (n sum rho^2)`` per age bucket), which merge across micro-batches.
    """
    cfg = cfg or LossSettings()
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]
    w = torch.ones_like(advantages, dtype=logp.dtype) if weights is None else weights.to(logp.dtype)
    denom = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
    denom = max(denom, 1.0)

    ratio = token_ratios(logp, behavior_logp, mask, cfg.sequence_ratio)

    if cfg.loss == "clip":
        unclipped = -adv * ratio
        clipped = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        per_token = torch.maximum(unclipped, clipped)
        clip_active = (clipped > unclipped).to(logp.dtype)
        if cfg.dual_clip is not None and cfg.dual_clip > 1.0:
            dual = -adv * cfg.dual_clip  # positive where adv < 0
            per_token = torch.where(adv < 0, torch.minimum(per_token, dual), per_token)
            clip_active = torch.where((adv < 0) & (per_token == dual), torch.ones_like(clip_active), clip_active)
    else:  # truncated IS: the stop-gradient weight times the REINFORCE term
        trunc = torch.clamp(ratio.detach(), max=cfg.tis_cap)
        per_token = -trunc * adv * logp
        clip_active = (ratio.detach() > cfg.tis_cap).to(logp.dtype)

    loss = torch.where(mask > 0, w[:, None] * per_token, torch.zeros_like(per_token)).sum() / denom
    kl_value = 0.0
    if cfg.kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef is set but no ref_logp was given")
        diff = torch.where(mask > 0, ref_logp.to(logp.dtype) - logp, torch.zeros_like(logp))
        k3 = (torch.exp(diff) - diff - 1.0) * mask
        kl = k3.sum() / denom
        loss = loss + cfg.kl_coef * kl
        kl_value = float(kl.detach().item()) * denom / max(float(mask.sum().item()), 1.0)

    stats = LossStats()
    on = mask > 0
    stats.add_ratios(ratio.detach()[on], None if ages is None else ages.to(logp.dtype)[:, None].expand_as(logp)[on],
                     clip=(cfg.clip_low, cfg.clip_high))
    stats.clipped = float((clip_active * mask).sum().item())
    stats.kl_sum = kl_value * stats.tokens
    return loss, stats


class LossStats:
    """Statistics of :func:`grpo_loss` kept as sums over sampled tokens, so the statistics of
    micro-batches :meth:`merge` into exactly those of the whole batch. Read them with
    ``stats["clip_frac"]`` etc. or :meth:`summary` (ratio mean/max/min, clip fraction, KL,
    token count, and the normalised IS ESS overall and per age bucket, ``ess/age_<bucket>``, with
    the share of each bucket's tokens outside the clip range, ``clip_out/age_<bucket>``)."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.clipped = 0.0
        self.kl_sum = 0.0
        self.ratio_sum = self.ratio_sq = 0.0
        self.ratio_max, self.ratio_min = float("-inf"), float("inf")
        # name -> [n, sum, sum of squares, sum of ages, tokens outside the clip range]
        self.buckets: dict[str, list[float]] = {}

    def add_ratios(self, ratios: torch.Tensor, ages: torch.Tensor | None = None,
                   clip: tuple[float, float] | None = None) -> None:
        """Account sampled-token ratios (1-D) and, optionally, each one's age; with ``clip``
        (low, high), also how many lie outside ``[1 - low, 1 + high]`` per age bucket."""
        r = ratios.reshape(-1).double()
        if r.numel() == 0:
            return
        self.tokens += r.numel()
        self.ratio_sum += float(r.sum())
        self.ratio_sq += float((r * r).sum())
        self.ratio_max = max(self.ratio_max, float(r.max()))
        self.ratio_min = min(self.ratio_min, float(r.min()))
        if ages is not None:
            ages = ages.reshape(-1)
            for lo, hi in AGE_BUCKETS:
                inside = (ages >= lo) & (ages <= hi)
                sel = r[inside]
                if sel.numel():
                    b = self.buckets.setdefault(age_bucket_name(lo, hi), [0.0] * 5)
                    b[0] += sel.numel()
                    b[1] += float(sel.sum())
                    b[2] += float((sel * sel).sum())
                    b[3] += float(ages[inside].double().sum())
                    if clip is not None:
                        b[4] += float(((sel < 1.0 - clip[0]) | (sel > 1.0 + clip[1])).sum())

    def merge(self, other: "LossStats") -> "LossStats":
        """Add another micro-batch's statistics into this one; returns self."""
        self.tokens += other.tokens
        self.clipped += other.clipped
        self.kl_sum += other.kl_sum
        self.ratio_sum += other.ratio_sum
        self.ratio_sq += other.ratio_sq
        self.ratio_max, self.ratio_min = max(self.ratio_max, other.ratio_max), min(self.ratio_min, other.ratio_min)
        for name, values in other.buckets.items():
            b = self.buckets.setdefault(name, [0.0] * 5)
            for k, v in enumerate(values):
                b[k] += v
        return self

    def drift_rate(self) -> float | None:
        """How fast replayed data goes stale, per optimizer step of age: ``c`` in the model
        ``ESS(age) = exp(-c age)``, fitted through the per-bucket ESS of tokens older than 0
        (``-ln ESS_b / mean age_b``, weighted by tokens). None without such tokens."""
        num = den = 0.0
        for n, s1, s2, age_sum, _ in self.buckets.values():
            if n == 0 or age_sum <= 0:
                continue
            ess = max(_ess(n, s1, s2), 1e-12)
            num += n * (-math.log(min(ess, 1.0)))
            den += age_sum
        return num / den if den > 0 else None

    def clip_drift_rate(self) -> float | None:
        """How fast replayed data leaves the clip range, per optimizer step of age: ``q`` in the
        model ``P(|rho - 1| beyond the clip | age) = q age``, fitted through the tokens older
        than 0 (tokens outside / sum of their ages). None without such tokens."""
        outside = sum(b[4] for b in self.buckets.values() if b[3] > 0)
        ages = sum(b[3] for b in self.buckets.values() if b[3] > 0)
        return outside / ages if ages > 0 else None

    def summary(self) -> dict[str, float]:
        if self.tokens == 0:
            return {"ratio_mean": 1.0, "ratio_max": 1.0, "ratio_min": 1.0, "ess": 1.0, "clip_frac": 0.0, "kl": 0.0,
                    "tokens": 0.0}
        out = {"ratio_mean": self.ratio_sum / self.tokens, "ratio_max": self.ratio_max, "ratio_min": self.ratio_min,
               "ess": _ess(self.tokens, self.ratio_sum, self.ratio_sq)}
        for lo, hi in AGE_BUCKETS:
            name = age_bucket_name(lo, hi)
            if name in self.buckets:
                out[f"ess/age_{name}"] = _ess(*self.buckets[name][:3])
                out[f"clip_out/age_{name}"] = self.buckets[name][4] / self.buckets[name][0]
        out.update(clip_frac=self.clipped / self.tokens, kl=self.kl_sum / self.tokens, tokens=self.tokens)
        return out

    def __getitem__(self, key: str) -> float:
        return self.summary()[key]


def _ess(n: float, s1: float, s2: float) -> float:
    """Normalised Kish ESS from the count, sum and sum of squares of the ratios."""
    if n == 0:
        return 1.0
    if s2 != s2:
        return 0.0
    return 1.0 if s2 == 0.0 else s1 * s1 / s2 / n


def token_ratios(logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, sequence_ratio: bool = False) -> torch.Tensor:
    """``[B, T]`` importance ratios: per token, or the row's geometric mean broadcast to its tokens."""
    mask = mask.to(logp.dtype)
    # where, not multiply: unsampled positions may hold -inf (e.g. suppressed image-pad tokens).
    log_ratio = torch.where(mask > 0, logp - behavior_logp.to(logp.dtype), torch.zeros_like(logp))
    if sequence_ratio:
        seq = log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return torch.exp(seq)[:, None].expand_as(logp)
    return torch.exp(log_ratio)


def effective_sample_size(rho: torch.Tensor) -> float:
    """Kish's effective sample size ``(sum rho)^2 / sum rho^2``, divided by ``n`` (1 = all equal)."""
    rho = rho.double().reshape(-1)
    return _ess(rho.numel(), float(rho.sum()), float((rho * rho).sum()))
