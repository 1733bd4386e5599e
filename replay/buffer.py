"""The freshness-aware prioritized replay buffer (FreshPER) without a per-step refresh pass.

``P_t(i) ∝ (p_i * exp(-(t - t_i) / tau))^alpha = exp(k_i - alpha * t / tau)`` with
``k_i = alpha * log(p_i) + alpha * t_i / tau``. The factor in ``t`` is common to every item and
cancels, so the sum tree stores ``exp(k_i - K)`` (``K = alpha * t_ref / tau``, a reference offset)
and nothing changes as the optimizer steps. When new keys approach the float64 range the buffer
rebases (``t_ref`` moves to the newest step and every leaf is recomputed once, O(N)).
Mode ``refresh`` is the paper's O(N)-per-step rescan, kept only as a measured baseline.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from . import defaults
from .persistence import DefaultCodec, ItemCodec, ReplayCheckpointError, pack_items, read_checkpoint, unpack_items, write_checkpoint
from .sum_tree import MinTree, SumTree

log = logging.getLogger(__name__)

MODES = ("fresh", "per", "uniform", "refresh")
#: Rebase once a new log-leaf exceeds this: leaves stay below e^REBASE_LOG * p^alpha, so even
#: 10^9 of them sum far below float64's e^709.
REBASE_LOG = 500.0
_FORMAT_VERSION = 1
_CONFIG_KEYS = ("capacity", "mode", "alpha", "tau", "beta", "beta_final", "beta_anneal_steps", "eps", "is_target", "is_normalize")


class _SampleFields(NamedTuple):
    items: list[Any]
    indices: np.ndarray  # int64 item ids (stable across evictions), for ``update_priorities``
    weights: np.ndarray  # float64 importance-sampling weights, max 1
    ages: np.ndarray  # float64 ``step - t_i``, optimizer steps since collection


class ReplaySample(_SampleFields):
    """One sampled batch; unpacks as ``items, indices, weights, ages``.

    How each item came to be drawn is kept beside them, as attributes (float64, one per drawn
    item, computed from the state the draw used; nothing random): ``probabilities``, the
    sampling probability ``P(i)`` at ``step`` over the whole buffer; ``base_priorities``, ``p_i``
    (floored at ``eps``); ``freshness``, the age factor ``exp(-age / tau)`` (1 in modes without
    an age decay), so ``P(i) ∝ (p_i * freshness_i) ** alpha`` (``p_i ** 0`` in ``uniform``).
    """

    probabilities: np.ndarray
    base_priorities: np.ndarray
    freshness: np.ndarray

    def __new__(cls, items: list[Any], indices: np.ndarray, weights: np.ndarray, ages: np.ndarray,
                probabilities: np.ndarray | None = None, base_priorities: np.ndarray | None = None,
                freshness: np.ndarray | None = None) -> "ReplaySample":
        self = super().__new__(cls, items, indices, weights, ages)
        n = len(indices)
        self.probabilities = np.full(n, np.nan) if probabilities is None else probabilities
        self.base_priorities = np.full(n, np.nan) if base_priorities is None else base_priorities
        self.freshness = np.ones(n) if freshness is None else freshness
        return self


class ReplayBuffer:
    """Fixed-capacity FIFO replay with freshness-aware prioritized, stratified sampling.

    Item ids: ``add`` returns consecutive int64 ids; ``sample`` returns them as ``indices``, and
    ``update_priorities`` ignores ids that have been evicted since (so a learner never rewrites
    the priority of a newer item that took the slot). All public methods hold one lock, so a
    collector thread may ``add`` while the learner samples.

    ``alpha``: priority exponent; ``tau``: age decay in optimizer steps (the sampling half-life is
    ``tau * ln 2 / alpha``); ``beta`` -> ``beta_final`` over ``beta_anneal_steps``: IS exponent;
    ``eps``: floor on base priorities; ``is_target``: ``"base"`` corrects only the base-priority
    bias (keeps the age decay), ``"uniform"`` gives classical PER weights ``(N P(i))^-beta``;
    ``is_normalize``: divide by the largest weight in the ``"batch"`` or the whole ``"buffer"``.
    The defaults are ``train.py``'s (``replay.defaults``).
    """

    def __init__(
        self,
        capacity: int,
        mode: str = "fresh",
        alpha: float = defaults.ALPHA,
        tau: float = defaults.TAU,
        beta: float = defaults.BETA,
        beta_final: float = defaults.BETA_FINAL,
        beta_anneal_steps: int = defaults.BETA_ANNEAL_STEPS,
        eps: float = defaults.EPS,
        is_target: str = "base",
        is_normalize: str = "batch",
        seed: int | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if is_target not in ("base", "uniform") or is_normalize not in ("batch", "buffer"):
            raise ValueError("is_target must be 'base'|'uniform' and is_normalize 'batch'|'buffer'")
        if not (capacity >= 1 and alpha >= 0 and tau > 0 and eps > 0 and beta_anneal_steps >= 0):
            raise ValueError("need capacity >= 1, alpha >= 0, tau > 0, eps > 0, beta_anneal_steps >= 0")
        self.capacity, self.mode = int(capacity), mode
        self.alpha, self.tau, self.eps = float(alpha), float(tau), float(eps)
        self.beta, self.beta_final, self.beta_anneal_steps = float(beta), float(beta_final), int(beta_anneal_steps)
        self.is_target, self.is_normalize = is_target, is_normalize
        self.rng = np.random.default_rng(seed)
        # Exponent of the base priority and decay rate of the log-leaf, per mode.
        self._a = 0.0 if mode == "uniform" else self.alpha
        self._rate = self.alpha / self.tau if mode in ("fresh", "refresh") else 0.0
        self._p = np.zeros(self.capacity)  # base priorities, floored at eps
        self._logp = np.zeros(self.capacity)
        self._t = np.zeros(self.capacity)  # step at collection
        self._ids = np.full(self.capacity, -1, dtype=np.int64)
        self._key = np.zeros(self.capacity)  # log IS-weight denominators, see _is_key
        self._strata = np.arange(0.0)
        self._items = np.empty(self.capacity, dtype=object)  # a C-level gather per batch
        self._size = self._cursor = self._next_id = 0
        self._t_ref = 0.0  # fresh: reference step of the leaves; refresh: step of the last rescan
        self.rebases = 0  # how many O(N) rebases happened (fresh) / rescans (refresh)
        self._sum = SumTree(self.capacity)
        self._min = MinTree(self.capacity) if is_normalize == "buffer" else None
        self._lock = threading.RLock()

    # -- priorities ------------------------------------------------------------------------------

    def _log_leaf(self, slots: np.ndarray | slice) -> np.ndarray:
        return self._a * self._logp[slots] + self._rate * (self._t[slots] - self._t_ref)

    def _leaf(self, slots: np.ndarray | slice) -> np.ndarray:
        if self.mode == "refresh":  # the paper's form, recomputed for every item at every step
            age = self._t_ref - self._t[slots]
            return np.power(self._p[slots] * np.exp(-age / self.tau), self.alpha)
        return np.exp(self._log_leaf(slots))

    def _is_key(self, slots: np.ndarray | slice) -> np.ndarray:
        """log of the IS weight's denominator, up to a constant: ``w_i = exp(-beta * (key_i - key_ref))``."""
        key = self._a * self._logp[slots]
        if self.is_target == "uniform":
            key = key + self._rate * self._t[slots]
        return key

    def _rebuild(self) -> None:
        n = self._size
        self._sum.rebuild(self._leaf(slice(0, n)))
        self._key[:n] = self._is_key(slice(0, n))
        if self._min is not None:
            self._min.rebuild(self._key[:n])

    def _maybe_rebase(self, slots: np.ndarray) -> None:
        if self.mode == "fresh" and len(slots) and self._log_leaf(slots).max() > REBASE_LOG:
            self._rebase(float(self._t[: self._size].max()))

    def _rebase(self, t_ref: float) -> None:
        """Move the reference step and recompute every leaf once: O(N), every ~500 tau/alpha steps."""
        self._t_ref = t_ref
        self.rebases += 1
        log.debug("replay rebase #%d to t_ref=%s over %d items", self.rebases, t_ref, self._size)
        self._sum.rebuild(self._leaf(slice(0, self._size)))

    def _total(self) -> float:
        """The tree total, rebasing first if every leaf underflowed (possible only after steps
        that went backwards by ~1000 tau/alpha and evicted the newer items)."""
        total = self._sum.total
        if not 0.0 < total < np.inf:
            if self.mode == "fresh":
                self._rebase(float(self._t[: self._size].max()))
                total = self._sum.total
            if not 0.0 < total < np.inf:
                raise FloatingPointError(f"sampling weights sum to {total}: ages too large for mode {self.mode!r}")
        return total

    def _check_priorities(self, priorities: Sequence[float] | np.ndarray, n: int) -> np.ndarray:
        p = np.asarray(priorities, dtype=np.float64).reshape(-1)
        if len(p) != n:
            raise ValueError(f"got {n} items/indices but {len(p)} priorities")
        if n and not (p.min() >= 0 and p.max() < np.inf):  # also false for NaN
            raise ValueError("priorities must be finite and >= 0")
        return np.maximum(p, self.eps)

    def advance(self, step: float) -> None:
        """Tell the buffer the optimizer step. ``fresh``/``per``/``uniform``: nothing to do, O(1).
        ``refresh``: the paper's pass, rescaling every stored priority and rebuilding, O(N)."""
        with self._lock:
            if self.mode == "refresh" and step != self._t_ref:
                self._t_ref = float(step)
                self.rebases += 1
                self._sum.rebuild(self._leaf(slice(0, self._size)))

    # -- public API ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def add(self, items: Iterable[Any], priorities: Sequence[float] | np.ndarray, step: float) -> np.ndarray:
        """Store ``items`` collected at optimizer ``step`` with base ``priorities`` (floored at
        ``eps``); the oldest items are evicted when full. Returns their ids. O(n + log N)."""
        items = list(items)
        p = self._check_priorities(priorities, len(items))
        with self._lock:
            self.advance(step)
            n, cap = len(items), self.capacity
            ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
            if n > cap:  # only the last `capacity` survive; skip writing the rest
                skip = n - cap
                self._cursor, self._next_id = (self._cursor + skip) % cap, self._next_id + skip
                items, p, n = items[skip:], p[skip:], cap
            start = self._cursor
            first = min(n, cap - start)  # the ring wraps at most once
            self._write(start, items[:first], p[:first], step)
            if first < n:
                self._write(0, items[first:], p[first:], step)
            return ids

    def _write(self, start: int, items: list[Any], p: np.ndarray, step: float) -> None:
        """Store one contiguous run of new items at ``start`` (the cursor) and index them."""
        n = len(items)
        sl = slice(start, start + n)
        self._p[sl], self._logp[sl], self._t[sl] = p, np.log(p), float(step)
        self._ids[sl] = np.arange(self._next_id, self._next_id + n)
        for slot, item in enumerate(items, start):  # one by one: lists stay objects
            self._items[slot] = item
        self._size = min(self._size + n, self.capacity)
        self._cursor, self._next_id = (start + n) % self.capacity, self._next_id + n
        if self.mode == "fresh":
            log_leaf = self._log_leaf(sl)
            if log_leaf.max() > REBASE_LOG:
                self._rebase(float(self._t[: self._size].max()))
            else:
                self._sum.set_range(start, np.exp(log_leaf))
        else:
            self._sum.set_range(start, self._leaf(sl))
        self._key[sl] = self._is_key(sl)
        if self._min is not None:
            self._min.set_range(start, self._key[sl])

    def update_priorities(self, indices: Sequence[int] | np.ndarray, priorities: Sequence[float] | np.ndarray) -> int:
        """Set new base priorities for item ids; ids evicted since sampling are skipped.
        Returns how many were updated."""
        ids = np.asarray(indices, dtype=np.int64).reshape(-1)
        p = self._check_priorities(priorities, len(ids))
        with self._lock:
            live = (ids >= self._next_id - self._size) & (ids < self._next_id)
            if not live.all():
                log.debug("update_priorities: skipping %d evicted ids", int((~live).sum()))
            slots, p = ids[live] % self.capacity, p[live]
            self._p[slots], self._logp[slots] = p, np.log(p)
            before = self.rebases
            self._maybe_rebase(slots)
            if self.rebases == before:
                self._sum.set(slots, self._leaf(slots))
            self._key[slots] = self._is_key(slots)
            if self._min is not None:
                self._min.set(slots, self._key[slots])
            return int(live.sum())

    def set_tau(self, tau: float) -> None:
        """Change the age decay from now on. Afterwards the buffer samples exactly as one built
        with this ``tau`` would (every leaf is recomputed once: O(N))."""
        tau = float(tau)
        if not (tau > 0 and np.isfinite(tau)):
            raise ValueError(f"tau must be a positive number, got {tau}")
        with self._lock:
            self.tau = tau
            self._rate = self.alpha / self.tau if self.mode in ("fresh", "refresh") else 0.0
            if self.mode == "fresh" and self._size:
                self._t_ref = float(self._t[: self._size].max())
            self._rebuild()

    def beta_at(self, step: float) -> float:
        """beta annealed linearly from ``beta`` to ``beta_final`` over ``beta_anneal_steps``."""
        if self.beta_anneal_steps == 0:
            return self.beta_final
        frac = min(max(step / self.beta_anneal_steps, 0.0), 1.0)
        return self.beta + (self.beta_final - self.beta) * frac

    def sample(self, batch_size: int, step: float) -> ReplaySample:
        """Draw ``batch_size`` items with replacement, one per equal-mass stratum.
        O(B log N); in ``refresh`` mode a changed ``step`` first costs the O(N) rescan."""
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        with self._lock:
            if self._size == 0:
                raise ValueError("cannot sample from an empty replay buffer")
            self.advance(step)
            if len(self._strata) != batch_size:
                self._strata = np.arange(float(batch_size))
            total = self._total()
            u = self.rng.random(batch_size)
            u += self._strata
            u *= total / batch_size
            slots = self._sum.find(u)
            np.minimum(slots, self._size - 1, out=slots)
            key = self._key[slots]
            key -= key.min() if self._min is None else self._min.root
            key *= -self.beta_at(step)
            weights = np.exp(key, out=key)
            ages = self._t[slots]
            np.subtract(step, ages, out=ages)
            probabilities = self._sum.leaves[slots] / total
            freshness = np.exp(-ages / self.tau) if self.mode in ("fresh", "refresh") else np.ones(len(slots))
            return ReplaySample(self._items[slots].tolist(), self._ids[slots], weights, ages,
                                probabilities, self._p[slots], freshness)

    def _order(self) -> np.ndarray:
        """Stored slots from oldest to newest."""
        if self._size < self.capacity:
            return np.arange(self._size)
        return (self._cursor + np.arange(self.capacity)) % self.capacity

    def probabilities(self, step: float) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, P)``: the exact sampling distribution at ``step`` over stored items, oldest first."""
        with self._lock:
            self.advance(step)
            if self._size:
                self._total()
            slots = self._order()
            leaves = self._sum.leaves[slots]
            return self._ids[slots].copy(), leaves / leaves.sum()

    def items(self) -> tuple[np.ndarray, list[Any], np.ndarray, np.ndarray]:
        """``(ids, items, base priorities, steps)`` of the stored items, oldest first."""
        with self._lock:
            slots = self._order()
            return self._ids[slots].copy(), self._items[slots].tolist(), self._p[slots].copy(), self._t[slots].copy()

    def age_stats(self, step: float, edges: Sequence[float] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)) -> dict[str, Any]:
        """Ages of stored items for logging: size, mean/min/max, a histogram over ``edges``
        (last bucket open-ended) and the sampling mass per bucket."""
        with self._lock:
            n = self._size
            if n == 0:
                return {"size": 0}
            ages = step - self._t[:n]
            bucket = np.searchsorted(np.asarray(edges, dtype=np.float64), ages, side="right") - 1
            bucket = np.clip(bucket, 0, len(edges) - 1)
            leaves = self._sum.leaves[:n]
            return {
                "size": n,
                "age_mean": float(ages.mean()),
                "age_min": float(ages.min()),
                "age_max": float(ages.max()),
                "age_edges": list(edges),
                "age_hist": np.bincount(bucket, minlength=len(edges)).tolist(),
                "age_mass": (np.bincount(bucket, weights=leaves, minlength=len(edges)) / leaves.sum()).tolist(),
            }

    # -- persistence -----------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, codec: ItemCodec | None = None) -> None:
        """Write the whole buffer atomically (temp file, fsync, rename); items via ``codec``."""
        with self._lock:
            n = self._size
            offsets, data = pack_items(self._items[:n].tolist(), codec or DefaultCodec())
            meta = {k: getattr(self, k) for k in _CONFIG_KEYS}
            meta.update(
                version=_FORMAT_VERSION, size=n, cursor=self._cursor, next_id=self._next_id,
                t_ref=self._t_ref, rebases=self.rebases, rng=self.rng.bit_generator.state,
            )
            arrays = {"p": self._p[:n], "t": self._t[:n], "ids": self._ids[:n], "item_offsets": offsets, "item_data": data}
            write_checkpoint(path, meta, arrays)

    @classmethod
    def load(cls, path: str | os.PathLike, codec: ItemCodec | None = None) -> "ReplayBuffer":
        """Rebuild a buffer from ``save``: same items, priorities, steps, cursor and RNG state,
        so it samples exactly what the saved one would have."""
        meta, arrays = read_checkpoint(path, ("p", "t", "ids", "item_offsets", "item_data"))
        if meta.get("version") != _FORMAT_VERSION:
            raise ReplayCheckpointError(f"{path!r}: unsupported replay format version {meta.get('version')}")
        try:
            buf = cls(**{k: meta[k] for k in _CONFIG_KEYS})
            n, cursor, next_id = int(meta["size"]), int(meta["cursor"]), int(meta["next_id"])
            p, t, ids = arrays["p"], arrays["t"], arrays["ids"]
            if not (0 <= n <= buf.capacity and len(p) == len(t) == len(ids) == n):
                raise ValueError("array lengths disagree with the stored size")
            if not (0 <= cursor < buf.capacity and next_id >= n and cursor == next_id % buf.capacity
                    and (n == buf.capacity or cursor == n)):
                raise ValueError(f"cursor {cursor} / next id {next_id} impossible for {n} items of {buf.capacity}")
            if p.dtype.kind != "f" or t.dtype.kind != "f" or ids.dtype.kind not in "iu":
                raise ValueError("priority, step or id arrays have the wrong dtype")
            if n and not (np.all(np.isfinite(p)) and p.min() > 0 and np.all(np.isfinite(t))):
                raise ValueError("priorities must be finite and > 0 and steps finite")
            if n and not (np.array_equal(ids % buf.capacity, np.arange(n)) and ids.min() >= next_id - n
                          and ids.max() < next_id):
                raise ValueError("item ids do not map onto the stored slots")
            items = unpack_items(arrays["item_offsets"], arrays["item_data"], codec or DefaultCodec())
            if len(items) != n:
                raise ValueError(f"{len(items)} items for a stored size of {n}")
            buf.rng.bit_generator.state = meta["rng"]
            t_ref, rebases = float(meta["t_ref"]), int(meta["rebases"])
        except ReplayCheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError, MemoryError,
                struct.error, UnicodeDecodeError) as exc:
            raise ReplayCheckpointError(f"replay checkpoint {path!r} is inconsistent: {type(exc).__name__}: {exc}") from exc
        buf._p[:n], buf._t[:n], buf._ids[:n] = arrays["p"], arrays["t"], arrays["ids"]
        buf._logp[:n] = np.log(buf._p[:n])
        for slot, item in enumerate(items):
            buf._items[slot] = item
        buf._size, buf._cursor, buf._next_id = n, cursor, next_id
        buf._t_ref, buf.rebases = t_ref, rebases
        buf._rebuild()
        return buf
