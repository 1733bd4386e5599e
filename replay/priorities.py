"""Base priorities: how much a trajectory is worth replaying, before the age decay.

The floor ``eps`` keeps zero-return trajectories sampleable and is applied to the base priority
(before the decay), which keeps the freshness factorisation exact (see docs/design.md).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import defaults


def abs_return_priority(returns: Sequence[float] | np.ndarray, eps: float = defaults.EPS) -> np.ndarray:
    """``|return| + eps``: the paper's base priority."""
    return np.abs(np.asarray(returns, dtype=np.float64)) + eps


def abs_advantage_priority(advantages: Sequence[float] | np.ndarray, eps: float = defaults.EPS) -> np.ndarray:
    """``|advantage| + eps``: favours trajectories that carry a learning signal in GRPO."""
    return np.abs(np.asarray(advantages, dtype=np.float64)) + eps


def function_priority(fn: Callable[[Any], float], items: Iterable[Any], eps: float = defaults.EPS) -> np.ndarray:
    """``max(fn(item), 0) + eps`` for a user scoring function over opaque items."""
    values = np.fromiter((float(fn(item)) for item in items), dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError("priority function returned a non-finite value")
    return np.maximum(values, 0.0) + eps
