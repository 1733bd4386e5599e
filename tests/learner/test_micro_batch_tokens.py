"""``--micro-batch-tokens``: forward/backward passes capped in padded tokens, so a real model's
long multi-turn batches fit in memory; the update is the same as the uncut one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agents.record import Sample
from learner.batch import MicroBatch, _chunks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _sample(n: int) -> Sample:
    return Sample(np.arange(n), np.r_[np.zeros(n - 1), 1], np.zeros(n))


def test_passes_stay_within_the_token_cap_in_order_and_a_long_sequence_goes_alone() -> None:
    rows = [(i, _sample(n)) for i, n in enumerate([10, 30, 20, 5, 50, 8, 8, 8])]
    chunks = _chunks(rows, MicroBatch(samples=3, tokens=60), lambda row: len(row[1].token_ids))
    assert [r for c in chunks for r in c] == rows  # every row once, in order
    for c in chunks:
        padded = len(c) * max(len(s.token_ids) for _, s in c)
        assert len(c) <= 3 and (padded <= 60 or len(c) == 1)
    assert _chunks(rows, MicroBatch(samples=3)) == _chunks(rows, 3) == [rows[:3], rows[3:6], rows[6:]]


def test_the_capped_update_equals_the_uncut_one() -> None:
    sys.path.insert(0, str(FIXTURES))
    from sharded_records import fixed_records

    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from learner.batch import make_batches
    from learner.loss import LossSettings
    from learner.update import policy_update

    records = fixed_records("text")
    n = len(records)
    cut = MicroBatch(samples=256, tokens=2 * max(len(s.token_ids) for r in records for s in r.samples))
    assert len(make_batches(records, micro_batch=cut)) > 2 and len(make_batches(records, micro_batch=256)) == 1
    results = []
    for micro in (256, cut):
        torch.manual_seed(0)
        policy, ref = Policy.from_pretrained(build_tiny_model("text")), Policy.from_pretrained(build_tiny_model("text"))
        opt = torch.optim.SGD(policy.model.parameters(), lr=0.0)
        stats = policy_update(policy, ref, opt, None, records, np.linspace(0.5, 1.5, n), np.arange(n, dtype=float),
                              loss_cfg=LossSettings(kl_coef=0.04), on_policy=False, max_grad_norm=1e9, micro_batch=micro)
        results.append((stats, {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    for key in ("loss", "grad_norm", "kl", "tokens"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    for key in ga:
        torch.testing.assert_close(gb[key], ga[key], atol=1e-6, rtol=1e-4)
