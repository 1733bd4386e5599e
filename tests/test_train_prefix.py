"""Shared-prefix log-probs equal the full forward pass on sampled tokens, values and gradients."""

from __future__ import annotations

import numpy as np
import torch

from learner.prefix import common_prefix_length, sampled_logprobs


def test_common_prefix_length() -> None:
    assert common_prefix_length([np.array([1, 2, 3, 4]), np.array([1, 2, 5]), np.array([1, 2, 3])]) == 2
    assert common_prefix_length([np.array([1, 2]), np.array([1, 2])]) == 2


def test_shared_prefix_matches_full_forward_with_gradients() -> None:
    from agents.policy import Policy
    from agents.runner import Runner
    from agents.tiny import build_tiny_model

    torch.manual_seed(0)
    policy = Policy.from_pretrained(build_tiny_model("text"))
    records, _ = Runner(policy, "freshper/FrozenLake-v0", group_size=2, max_new_tokens=4, seed=5).collect(
        [21, 22], policy_version=0)
    samples = [s for r in records for s in r.samples][:24]
    mask = torch.zeros(len(samples), max(len(s.token_ids) for s in samples))
    for i, s in enumerate(samples):
        mask[i, : len(s.token_ids)] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
    assert common_prefix_length([s.token_ids for s in samples]) >= 8  # the shared path is taken

    full = policy.token_logprobs(samples)
    torch.where(mask > 0, full, torch.zeros_like(full)).sum().backward()
    g_full = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad()
    fast = sampled_logprobs(policy, samples)
    torch.where(mask > 0, fast, torch.zeros_like(fast)).sum().backward()
    g_fast = [p.grad.clone() for p in policy.model.parameters()]

    assert fast.shape == full.shape
    assert float(((fast - full).detach().abs() * mask).max()) < 1e-5
    for a, b in zip(g_full, g_fast):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)  # float32 summation order differs
