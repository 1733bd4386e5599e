"""``--tau auto``: set FreshPER's age decay online from the measured policy drift.

The paper fixes tau by hand. Here the drift is measured instead: every replay update logs the
IS effective sample size of its tokens per age bucket, and the drift rate ``c`` is fitted to
``ESS(age) = exp(-c age)`` (:meth:`learner.loss.LossStats.drift_rate`). Under FreshPER's
sampling, the ages of replayed items are (for a buffer that receives a batch every step)
exponential with rate ``alpha / tau``, so the expected ESS of a replayed token is

    E[exp(-c age)] = 1 / (1 + c tau / alpha)

and keeping it at ``target`` gives ``tau = alpha (1 / target - 1) / c``. A policy that drifts
faster (larger c) gets a shorter memory.

``signal="clip"`` steers by another measure of the same drift: the share of replayed tokens whose
ratio lies outside the clip range, which the loss cuts off. It grows with age roughly linearly,
``P(outside | age) = q age`` (:meth:`learner.loss.LossStats.clip_drift_rate` fits q), so under
the same exponential ages the expected share is ``q tau / alpha``, and keeping it at
``target_clip`` gives ``tau = alpha target_clip / q``. Where the token ESS stays near 1 and is
noisy (small per-token ratios, a few outliers), the clipped share still rises with age.

 ``c`` is smoothed with an exponential moving average,
tau is kept within ``[tau_min, tau_max]``, and the buffer is re-keyed (O(N)) only when tau moves
by more than ``min_change`` (relative).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class TauController:
    alpha: float = 1.0
    target_ess: float = 0.9
    tau: float = 10.0
    signal: str = "ess"  # "ess": keep the replayed tokens' ESS at target_ess; "clip": their clipped share at target_clip
    target_clip: float = 0.05
    tau_min: float = 1.0
    tau_max: float = 10_000.0
    smoothing: float = 0.9  # EMA weight of the previous drift estimate
    min_change: float = 0.05
    drift: float | None = None  # the smoothed drift rate c

    def __post_init__(self) -> None:
        if not 0.0 < self.target_ess < 1.0:
            raise ValueError(f"target ESS must be in (0, 1), got {self.target_ess}")
        if not 0.0 < self.target_clip < 1.0:
            raise ValueError(f"target clipped share must be in (0, 1), got {self.target_clip}")
        if self.signal not in ("ess", "clip"):
            raise ValueError(f"signal must be 'ess' or 'clip', got {self.signal!r}")

    @property
    def metric(self) -> str:
        """The update statistic this controller reads (learner.update's output)."""
        return "drift_per_step" if self.signal == "ess" else "clip_drift_per_step"

    def tau_for(self, drift: float) -> float:
        """The tau that keeps the expected replayed-token ESS (or clipped share) at the target,
        for drift ``c`` (or ``q``)."""
        if drift <= 0:
            return self.tau_max
        scale = (1.0 / self.target_ess - 1.0) if self.signal == "ess" else self.target_clip
        return min(self.tau_max, max(self.tau_min, self.alpha * scale / drift))

    def observe(self, drift: float | None) -> bool:
        """Account one replay update's drift estimate; return True when tau changed enough
        that the buffer should be re-keyed (read the new value from ``self.tau``)."""
        if drift is None or not math.isfinite(drift):
            return False
        self.drift = drift if self.drift is None else self.smoothing * self.drift + (1 - self.smoothing) * drift
        new = self.tau_for(self.drift)
        if abs(new - self.tau) > self.min_change * self.tau:
            self.tau = new
            return True
        return False

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
