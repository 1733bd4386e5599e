"""Gymnasium spaces for free text."""

from __future__ import annotations

import string
from typing import Any

import gymnasium as gym
import numpy as np

_PRINTABLE = string.printable


class AnyText(gym.spaces.Text):
    """A text space that contains any ``str`` up to ``max_length`` characters.

    ``gymnasium.spaces.Text`` restricts membership to a fixed charset; model replies and
    observations are arbitrary Unicode, so membership here only checks type and length.
    ``sample()`` draws printable ASCII, which is enough for checkers and fuzzing.
    """

    def __init__(self, max_length: int = 1 << 20, *, min_length: int = 0, seed: Any = None) -> None:
        super().__init__(max_length=max_length, min_length=min_length, charset=_PRINTABLE, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        length = int(self.np_random.integers(self.min_length, min(self.max_length, 64) + 1))
        chars = np.array(list(_PRINTABLE))
        return "".join(self.np_random.choice(chars, size=length))

    def __repr__(self) -> str:
        return f"AnyText(max_length={self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, AnyText) and other.max_length == self.max_length and other.min_length == self.min_length
