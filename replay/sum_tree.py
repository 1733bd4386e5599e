"""Flat-array binary trees over float64 leaves: sums for sampling, minima for IS weights.

Both trees use the 1-based heap layout (root at 1, children of ``i`` at ``2i`` and ``2i + 1``,
leaves at ``[n_leaves, 2 * n_leaves)``). Every parent is recomputed from its two children rather
than adjusted by a delta, so a tree is a pure function of its leaves: no drift accumulates, and a
tree rebuilt from saved leaves is bit-identical to the one that was saved.
"""

from __future__ import annotations

import operator

import numpy as np

#: Sampling starts with one ``searchsorted`` over the cumulative sums of this tree level (1024
#: nodes at most: a bounded cost, kept current lazily), then descends the levels below.
TOP_LEVEL = 10


class _FlatTree:
    """Shared layout and update logic; subclasses choose the combine function and the fill."""

    _fill = 0.0

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.depth = (self.capacity - 1).bit_length()
        self.n_leaves = 1 << self.depth
        self.tree = np.full(2 * self.n_leaves, self._fill, dtype=np.float64)

    @staticmethod
    def _combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _changed(self, first_slot: int = 0) -> None:
        """Hook for caches that depend on the tree; slots below ``first_slot`` did not change."""

    @property
    def leaves(self) -> np.ndarray:
        """The stored leaf values (a read-only view, one per slot)."""
        view = self.tree[self.n_leaves : self.n_leaves + self.capacity]
        view.flags.writeable = False
        return view

    def set_range(self, start: int, values: np.ndarray) -> None:
        """Write ``values`` to the contiguous slots ``start, start + 1, ...``: O(len + log N)."""
        t, lo = self.tree, start + self.n_leaves
        hi = lo + len(values)
        if not 0 <= start or hi > self.n_leaves + self.capacity:
            raise IndexError("slot range out of bounds")
        t[lo:hi] = values
        while lo > 1 and hi - lo > 1:
            lo, hi = lo >> 1, ((hi - 1) >> 1) + 1
            t[lo:hi] = self._combine(t[2 * lo : 2 * hi : 2], t[2 * lo + 1 : 2 * hi : 2])
        combine = self._scalar_combine
        while lo > 1:  # one node per level from here up: scalar arithmetic is far cheaper
            lo >>= 1
            t[lo] = combine(t[2 * lo], t[2 * lo + 1])
        self._changed(start)

    def set(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` to arbitrary ``slots`` (last write wins on repeats): O(B log N)."""
        idx = np.asarray(slots, dtype=np.int64) + self.n_leaves
        if len(idx) == 0:
            return
        first = int(idx.min()) - self.n_leaves
        t = self.tree
        t[idx] = values
        for _ in range(self.depth):
            idx >>= 1
            t[idx] = self._combine(t[2 * idx], t[2 * idx + 1])
        self._changed(first)

    def rebuild(self, values: np.ndarray) -> None:
        """Replace all leaves (missing tail slots get the fill) and recompute every node: O(N)."""
        t, n = self.tree, self.n_leaves
        t[n:] = self._fill
        t[n : n + len(values)] = values
        for level in range(self.depth - 1, -1, -1):
            s = 1 << level
            t[s : 2 * s] = self._combine(t[2 * s : 4 * s : 2], t[2 * s + 1 : 4 * s : 2])
        self._changed()

    @property
    def root(self) -> float:
        return float(self.tree[1])


class SumTree(_FlatTree):
    """Sum tree whose draws descend all together, vectorised over the batch."""

    _fill = 0.0
    _combine = staticmethod(np.add)
    _scalar_combine = staticmethod(operator.add)  # the same IEEE double addition

    def __init__(self, capacity: int, top_level: int = TOP_LEVEL) -> None:
        super().__init__(capacity)
        self._top = min(top_level, self.depth)
        self._cum = np.zeros((1 << self._top) + 1)  # [0, inclusive prefix sums of the top level]
        self._dirty_from = 0  # top-level entries from here on are stale

    def _changed(self, first_slot: int = 0) -> None:
        self._dirty_from = min(self._dirty_from, first_slot >> (self.depth - self._top))

    def top_cumsum(self) -> np.ndarray:
        """Prefix sums over the top level with a leading 0 (the last entry is the total the
        draws use), brought up to date lazily from the first stale entry. ``np.cumsum``
        accumulates sequentially, so the result is bit-identical to a full recomputation."""
        s, d = 1 << self._top, self._dirty_from
        if d < s:
            c, top = self._cum, self.tree[s : 2 * s]
            c[d + 1 :] = np.cumsum(np.concatenate((c[d : d + 1], top[d:])))[1:]
            self._dirty_from = s
        return self._cum

    @property
    def total(self) -> float:
        return float(self.top_cumsum()[-1])

    def find(self, u: np.ndarray) -> np.ndarray:
        """Slots whose cumulative-sum interval holds each ``u`` in ``[0, total)`` (``u`` is
        consumed: it is overwritten with residuals).

        One ``searchsorted`` to the top level, then one loop step per remaining level, each a
        handful of whole-batch numpy operations (no Python loop over draws). Rounding can put a
        draw just past the last positive leaf; callers clamp to the stored range.
        """
        t, s = self.tree, 1 << self._top
        cum = self.top_cumsum()
        j = np.searchsorted(cum[1:], u, side="right")
        np.minimum(j, s - 1, out=j)
        u -= cum[j]  # the residual inside top-level node j
        idx = j
        idx += s
        for _ in range(self.depth - self._top):
            idx += idx
            left = t[idx]
            right = u >= left
            left *= right
            u -= left
            idx += right
        idx -= self.n_leaves
        return idx


class MinTree(_FlatTree):
    """Min tree: the smallest leaf in O(1), kept current in O(log N) per write."""

    _fill = np.inf
    _combine = staticmethod(np.minimum)
    _scalar_combine = staticmethod(min)
