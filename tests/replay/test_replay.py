"""The replay buffer samples exactly the FreshPER distribution, with the promised IS weights."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from collections import OrderedDict

import numpy as np
import pytest

from replay import ReplayBuffer, abs_advantage_priority, abs_return_priority, defaults, function_priority


class Reference:
    """Brute-force model: FIFO of (p, t) per id and the closed-form distribution."""

    def __init__(self, capacity: int, mode: str, alpha: float, tau: float, eps: float = defaults.EPS) -> None:
        self.capacity, self.mode, self.alpha, self.tau, self.eps = capacity, mode, alpha, tau, eps
        self.store: OrderedDict[int, list[float]] = OrderedDict()

    def add(self, ids, priorities, step) -> None:
        for i, p in zip(ids, priorities):
            self.store[int(i)] = [max(float(p), self.eps), float(step)]
            if len(self.store) > self.capacity:
                self.store.popitem(last=False)

    def update(self, ids, priorities) -> None:
        for i, p in zip(ids, priorities):
            if int(i) in self.store:
                self.store[int(i)][0] = max(float(p), self.eps)

    def log_weights(self, step: float) -> np.ndarray:
        p, t = np.array(list(self.store.values())).T
        if self.mode == "uniform":
            return np.zeros(len(p))
        decay = 0.0 if self.mode == "per" else (step - t) / self.tau
        return self.alpha * (np.log(p) - decay)  # log of (p * exp(-age / tau))^alpha

    def probabilities(self, step: float) -> np.ndarray:
        lw = self.log_weights(step)
        w = np.exp(lw - lw.max())
        return w / math.fsum(w)


def assert_matches(buf: ReplayBuffer, ref: Reference, step: float) -> None:
    ids, probs = buf.probabilities(step)
    assert ids.tolist() == list(ref.store)
    np.testing.assert_allclose(probs, ref.probabilities(step), rtol=1e-9, atol=1e-300)


def random_run(buf: ReplayBuffer, ref: Reference, rng: np.random.Generator, n_ops: int, step_jump: int = 3):
    """Random adds (with evictions), priority updates (some of evicted ids) and step advances."""
    step, issued = 0, 0
    for _ in range(n_ops):
        step += int(rng.integers(0, step_jump + 1))
        if rng.random() < 0.6 or issued == 0:
            n = int(rng.integers(1, 2 * buf.capacity + 2))
            pr = rng.exponential(1.0, n) * (rng.random(n) < 0.8)  # some zeros hit the eps floor
            ids = buf.add([f"item{issued + k}" for k in range(n)], pr, step)
            assert ids.tolist() == list(range(issued, issued + n))
            issued += n
            ref.add(ids, pr, step)
        else:
            ids = rng.integers(max(0, issued - 2 * buf.capacity), issued, int(rng.integers(1, 20)))
            ids = np.unique(ids)
            pr = rng.exponential(2.0, len(ids))
            updated = buf.update_priorities(ids, pr)
            assert updated == sum(int(i) in ref.store for i in ids)
            ref.update(ids, pr)
        yield step


@pytest.mark.parametrize("mode", ["fresh", "per", "uniform", "refresh"])
@pytest.mark.parametrize("alpha,tau", [(0.6, 5.0), (1.0, 500.0), (0.3, 0.7)])
@pytest.mark.parametrize("capacity", [1, 7, 64])
def test_probabilities_match_closed_form_under_adds_evictions_and_updates(mode, alpha, tau, capacity):
    rng = np.random.default_rng(capacity * 1000 + int(alpha * 10))
    buf = ReplayBuffer(capacity, mode=mode, alpha=alpha, tau=tau, seed=1)
    ref = Reference(capacity, mode, alpha, tau)
    for step in random_run(buf, ref, rng, 120):
        assert_matches(buf, ref, step)
        assert_matches(buf, ref, step + 17)  # the distribution at a later step, before any add
        assert len(buf) == len(ref.store)


@pytest.mark.parametrize("alpha,tau", [(0.6, 50.0), (1.0, 3.0)])
def test_long_run_to_a_million_steps_rebases_and_stays_exact(alpha, tau):
    rng = np.random.default_rng(7)
    buf = ReplayBuffer(300, mode="fresh", alpha=alpha, tau=tau, beta=0.5, beta_final=0.5, seed=0,
                       is_target="uniform", is_normalize="buffer")  # weights need the global minimum
    ref = Reference(300, "fresh", alpha, tau)
    step = 0
    while step < 1_000_000:
        step += int(rng.integers(1, 2000))
        pr = rng.exponential(1.0, 16)
        ref.add(buf.add(range(16), pr, step), pr, step)
        if rng.random() < 0.3:
            live = np.array(list(ref.store))[rng.integers(0, len(ref.store), 8)]
            pr = rng.exponential(1.0, 8)
            buf.update_priorities(live, pr)
            ref.update(live, pr)
        assert_matches(buf, ref, step)
    assert step >= 1_000_000
    assert buf.rebases >= 5, "a long run with small tau must have rebased several times"
    assert np.all(np.isfinite(buf._sum.tree))
    s = buf.sample(64, step)  # classical weights (N P_i)^-beta / max_j, in the log domain
    lw = ref.log_weights(step)
    pos = s.indices - list(ref.store)[0]
    np.testing.assert_allclose(s.weights, np.exp(-0.5 * (lw[pos] - lw.min())), rtol=1e-8, atol=1e-300)


def test_fresh_equals_refresh_at_every_step_of_a_long_random_run():
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    fresh = ReplayBuffer(50, mode="fresh", alpha=0.7, tau=20.0, seed=5)
    refresh = ReplayBuffer(50, mode="refresh", alpha=0.7, tau=20.0, seed=5)
    run_a = random_run(fresh, Reference(50, "fresh", 0.7, 20.0), rng_a, 600, step_jump=2)
    run_b = random_run(refresh, Reference(50, "refresh", 0.7, 20.0), rng_b, 600, step_jump=2)
    for step_a, step_b in zip(run_a, run_b):
        assert step_a == step_b
        ids_a, p_a = fresh.probabilities(step_a)
        ids_b, p_b = refresh.probabilities(step_b)
        assert ids_a.tolist() == ids_b.tolist()
        np.testing.assert_allclose(p_a, p_b, rtol=1e-9, atol=1e-300)
    assert refresh.rebases > 100  # the baseline really did rescan per step


def chi_square_threshold(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) by Wilson-Hilferty; z = 3.719 is the 1e-4 tail."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def empirical_chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected >= 5  # pool the cells too small for the approximation
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    nonzero = exp > 0
    stat = float((((obs - exp) ** 2)[nonzero] / exp[nonzero]).sum())
    return stat, int(nonzero.sum()) - 1


@pytest.mark.parametrize("mode", ["fresh", "per", "uniform"])
def test_sampling_frequencies_pass_chi_square_against_closed_form(mode):
    rng = np.random.default_rng(11)
    buf = ReplayBuffer(200, mode=mode, alpha=0.8, tau=30.0, seed=123)
    ref = Reference(200, mode, 0.8, 30.0)
    for step in range(0, 300, 10):  # 30 adds of 10 into 200 slots: evictions and a wrapped ring
        pr = rng.exponential(1.0, 10)
        ref.add(buf.add(range(10), pr, step), pr, step)
    step = 300
    ids, probs = buf.probabilities(step)
    np.testing.assert_allclose(probs, ref.probabilities(step), rtol=1e-9)
    counts = np.zeros(len(ids))
    for _ in range(400):
        counts += np.bincount(buf.sample(256, step).indices - ids[0], minlength=len(ids))
    stat, df = empirical_chi_square(counts, probs)
    assert stat < chi_square_threshold(df), (stat, df)
    if mode == "fresh":  # the test has power: the no-decay distribution is rejected outright
        wrong = Reference(200, "per", 0.8, 30.0)
        wrong.store = ref.store
        stat_wrong, df_wrong = empirical_chi_square(counts, wrong.probabilities(step))
        assert stat_wrong > 10 * chi_square_threshold(df_wrong)


def test_draws_are_stratified_one_per_equal_mass_stratum():
    buf = ReplayBuffer(4, mode="per", alpha=1.0, seed=0)
    buf.add("abcd", [1.0, 1.0, 1.0, 1.0], step=0)
    for _ in range(20):  # 4 equal items and 4 strata: every batch holds each item exactly once
        assert sorted(buf.sample(4, 0).indices.tolist()) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["fresh", "per", "uniform"])
def test_is_weights_in_both_conventions_match_hand_formulas(mode):
    rng = np.random.default_rng(2)
    kw = dict(mode=mode, alpha=0.6, tau=10.0, beta=0.5, beta_final=0.5, seed=4)
    bufs = {
        (tgt, norm): ReplayBuffer(40, is_target=tgt, is_normalize=norm, **kw)
        for tgt in ("base", "uniform") for norm in ("batch", "buffer")
    }
    for step in range(0, 60, 4):
        pr = rng.exponential(1.0, 5)
        for b in bufs.values():
            b.add(range(5), pr, step)
    step, beta, alpha = 70, 0.5, 0.6
    ids, probs = bufs["base", "batch"].probabilities(step)
    _, _, base_p, _ = bufs["base", "batch"].items()
    a = 0.0 if mode == "uniform" else alpha
    n = len(ids)
    for (tgt, norm), b in bufs.items():
        s = b.sample(64, step)
        pos = s.indices - ids[0]
        if tgt == "base":
            raw_all = base_p ** (-a * beta)
        else:
            raw_all = (n * probs) ** (-beta)
        denom = raw_all[pos].max() if norm == "batch" else raw_all.max()
        np.testing.assert_allclose(s.weights, raw_all[pos] / denom, rtol=1e-9)
        assert s.weights.max() <= 1.0 + 1e-12
        if norm == "batch":
            assert s.weights.max() == pytest.approx(1.0)
    if mode == "uniform":
        assert all(np.all(b.sample(16, step).weights == 1.0) for b in bufs.values())


def test_beta_anneals_linearly_then_holds_and_drives_the_weights():
    buf = ReplayBuffer(10, alpha=1.0, beta=0.4, beta_final=1.0, beta_anneal_steps=100, seed=0)
    assert buf.beta_at(0) == pytest.approx(0.4)
    assert buf.beta_at(50) == pytest.approx(0.7)
    assert buf.beta_at(100) == pytest.approx(1.0)
    assert buf.beta_at(10_000) == pytest.approx(1.0)
    const = ReplayBuffer(10, beta=0.5, beta_final=0.5, beta_anneal_steps=100)
    assert const.beta_at(0) == const.beta_at(77) == 0.5
    buf.add(["lo", "hi"], [1.0, 4.0], step=0)
    for step, beta in ((0, 0.4), (50, 0.7), (200, 1.0)):
        s = buf.sample(32, step)
        expected = np.where(np.array(s.items) == "hi", (4.0 ** -beta) / (1.0 ** -beta), 1.0)
        if "lo" not in s.items:
            expected = np.ones(32)
        np.testing.assert_allclose(s.weights, expected, rtol=1e-12)


def test_sample_unpacks_and_reports_ages_items_and_ids():
    buf = ReplayBuffer(8, seed=0)
    buf.add([{"k": i} for i in range(3)], [1, 2, 3], step=5)
    buf.add([{"k": 9}], [1], step=9)
    items, indices, weights, ages = buf.sample(16, 12)
    by_id = {0: 0, 1: 1, 2: 2, 3: 9}
    assert [it["k"] for it in items] == [by_id[int(i)] for i in indices]
    assert np.all(ages == np.where(indices == 3, 3.0, 7.0))
    assert weights.dtype == np.float64 and indices.dtype == np.int64
    one = buf.sample(1, 12)
    assert len(one.items) == 1


def test_fifo_eviction_and_stale_priority_updates_are_ignored():
    buf = ReplayBuffer(3, mode="per", alpha=1.0, seed=0)
    buf.add("abcde", [1, 1, 1, 1, 1], step=0)  # more than capacity at once: last three survive
    ids, items, _, _ = buf.items()
    assert ids.tolist() == [2, 3, 4] and items == ["c", "d", "e"]
    buf.add("f", [1], step=1)
    assert buf.items()[1] == ["d", "e", "f"]
    assert buf.update_priorities([0, 2, 5], [9.0, 9.0, 3.0]) == 1  # ids 0 and 2 are gone
    ids, probs = buf.probabilities(1)
    np.testing.assert_allclose(probs, [0.2, 0.2, 0.6])


def test_invalid_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="mode"):
        ReplayBuffer(4, mode="fifo")
    buf = ReplayBuffer(4)
    with pytest.raises(ValueError, match="empty"):
        buf.sample(2, 0)
    with pytest.raises(ValueError, match="priorities"):
        buf.add(["a", "b"], [1.0], step=0)
    with pytest.raises(ValueError, match="finite"):
        buf.add(["a"], [-1.0], step=0)
    with pytest.raises(ValueError, match="finite"):
        buf.add(["a"], [np.nan], step=0)


def test_age_stats_count_items_and_sampling_mass_per_bucket():
    buf = ReplayBuffer(10, alpha=1.0, tau=1.0)
    buf.add("ab", [1, 1], step=0)
    buf.add("c", [1], step=9)
    stats = buf.age_stats(10, edges=(0, 2, 8))
    assert stats["size"] == 3 and stats["age_min"] == 1 and stats["age_max"] == 10
    assert stats["age_mean"] == pytest.approx(7.0)
    assert stats["age_hist"] == [1, 0, 2]
    total = 2 * math.exp(-10) + math.exp(-1)
    np.testing.assert_allclose(stats["age_mass"], [math.exp(-1) / total, 0, 2 * math.exp(-10) / total])


def test_base_priority_helpers():
    np.testing.assert_allclose(abs_return_priority([-2.0, 0.0, 1.5], eps=1e-3), [2.001, 1e-3, 1.501])
    np.testing.assert_allclose(abs_advantage_priority([-0.5, 0.0], eps=1e-6), [0.500001, 1e-6])
    np.testing.assert_allclose(function_priority(len, ["ab", "", "abcd"], eps=0.5), [2.5, 0.5, 4.5])
    with pytest.raises(ValueError):
        function_priority(lambda x: float("nan"), [1])


def test_concurrent_add_from_a_collector_thread_while_the_learner_samples():
    buf = ReplayBuffer(500, mode="fresh", alpha=0.6, tau=50.0, seed=0)
    buf.add(range(10), np.ones(10), step=0)
    errors: list[BaseException] = []
    done = threading.Event()

    def collector() -> None:
        try:
            rng = np.random.default_rng(1)
            for step in range(1, 1500):
                buf.add([("t", step, k) for k in range(4)], rng.exponential(1.0, 4), step)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=collector)
    thread.start()
    draws = 0
    while not done.is_set() or draws < 200:
        s = buf.sample(64, 1500)
        assert len(s.items) == 64 and np.all(np.isfinite(s.weights)) and np.all(s.weights <= 1.0)
        buf.update_priorities(s.indices[:8], np.full(8, 2.0))
        draws += 1
    thread.join()
    assert not errors, errors
    assert len(buf) == 500
    ids, probs = buf.probabilities(1500)
    assert ids.tolist() == list(range(10 + 4 * 1499 - 500, 10 + 4 * 1499))
    leaves = buf._sum.leaves
    assert buf._sum.root == pytest.approx(leaves.sum(), rel=1e-12)
    assert probs.sum() == pytest.approx(1.0)


def test_replay_package_imports_numpy_only():
    code = "import sys, replay; bad = [m for m in ('torch', 'envs', 'agents', 'train') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("capacity,top_level", [(1, 14), (5, 1), (1000, 4), (5000, 14)])
def test_sum_tree_finds_the_slot_holding_each_draw_and_its_lazy_prefix_sums_are_exact(capacity, top_level):
    from replay import SumTree

    rng = np.random.default_rng(capacity)
    tree = SumTree(capacity, top_level=top_level)
    leaves = np.zeros(capacity)
    for _ in range(30):  # mixed writes; each is followed by a query so the lazy path is used
        if rng.random() < 0.5:
            start = int(rng.integers(0, capacity))
            vals = rng.exponential(1.0, int(rng.integers(1, capacity - start + 1)))
            tree.set_range(start, vals)
            leaves[start : start + len(vals)] = vals
        else:
            slots = rng.integers(0, capacity, 7)
            vals = rng.exponential(1.0, 7) * (rng.random(7) < 0.8)
            tree.set(slots, vals)
            for s_, v in zip(slots, vals):
                leaves[s_] = v
        if leaves.sum() == 0:
            continue
        fresh = SumTree(capacity, top_level=top_level)
        fresh.rebuild(leaves)
        assert np.array_equal(tree.top_cumsum(), fresh.top_cumsum())  # bit-identical
        assert np.array_equal(tree.tree, fresh.tree)
        u = np.sort(rng.random(64)) * tree.total
        u[0] = 0.0
        expected = np.searchsorted(np.cumsum(leaves), u, side="right")
        got = tree.find(u.copy())
        ok = (got == expected) | np.isclose(u, np.cumsum(leaves)[np.minimum(got, capacity - 1)], rtol=1e-12)
        assert ok.all()
        assert np.all(leaves[np.minimum(got, capacity - 1)] > 0)


def test_steps_that_go_backwards_far_still_sample_the_remaining_items():
    buf = ReplayBuffer(2, mode="fresh", alpha=1.0, tau=1.0, seed=0)
    buf.add(["new"], [1.0], step=1000)  # then a restart from step 0 evicts the newest item
    buf.add(["a", "b"], [1.0, 3.0], step=0)
    np.testing.assert_allclose(buf.probabilities(5)[1], [0.25, 0.75])
    assert set(buf.sample(64, 5).items) == {"a", "b"}


def test_items_come_back_as_the_same_objects_whatever_their_type():
    stored = [np.arange(3), (1, 2), [1, [2]], "s", {"k": np.zeros(2)}]
    buf = ReplayBuffer(8, mode="uniform", seed=0)
    ids = buf.add(stored, np.ones(5), step=0)
    s = buf.sample(50, 0)
    for item, i in zip(s.items, s.indices):
        assert item is stored[int(i - ids[0])]


def test_a_buffer_with_the_defaults_samples_as_a_training_runs_buffer() -> None:
    """The buffer's defaults are train.py's replay settings: built with its capacity alone, a buffer
    draws the same items with the same weights as the one a run builds from ``ReplaySettings``."""
    pytest.importorskip("torch")
    from learner.state import ReplaySettings

    settings = ReplaySettings(mode="fresh", seed=3)
    run, plain = settings.build(), ReplayBuffer(settings.capacity, seed=3)
    rng = np.random.default_rng(0)
    for step in range(0, 40, 2):
        returns = rng.exponential(1.0, 8) * (rng.random(8) < 0.5)  # some zero returns: the eps floor
        np.testing.assert_array_equal(abs_return_priority(returns), abs_return_priority(returns, settings.eps))
        for buf in (run, plain):
            buf.add([f"s{step}-{k}" for k in range(8)], abs_return_priority(returns, settings.eps), step)
    a, b = run.sample(32, 40), plain.sample(32, 40)
    assert a.items == b.items
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.probabilities, b.probabilities)
