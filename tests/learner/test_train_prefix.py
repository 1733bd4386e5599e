"""Shared-prompt log-probs equal the full forward pass on sampled tokens, values and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.record import Sample
from learner.prefix import common_prefix_length, group_prompts, prompt_lengths, sampled_logprobs


@pytest.fixture(scope="module")
def policy():
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    torch.manual_seed(0)
    return Policy.from_pretrained(build_tiny_model("text"))


def _mask(samples) -> torch.Tensor:
    mask = torch.zeros(len(samples), max(len(s.token_ids) for s in samples))
    for i, s in enumerate(samples):
        mask[i, : len(s.token_ids)] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
    return mask


def _assert_same_as_full_forward(policy, samples, temperature: float = 1.0) -> None:
    """Values on sampled positions and parameter gradients of their sum (weighted per position,
    so a wrong position or row cannot cancel out) match ``policy.token_logprobs``."""
    mask = _mask(samples)
    weights = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape) * mask
    policy.model.zero_grad(set_to_none=True)
    full = policy.token_logprobs(samples, temperature=temperature)
    torch.where(mask > 0, full * weights, torch.zeros_like(full)).sum().backward()
    g_full = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)
    fast = sampled_logprobs(policy, samples, temperature=temperature)
    torch.where(mask > 0, fast * weights, torch.zeros_like(fast)).sum().backward()
    g_fast = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)

    assert fast.shape == full.shape
    assert torch.isfinite(fast).all()
    assert float(((fast - full).detach().abs() * mask).max()) < 1e-5
    for a, b in zip(g_full, g_fast):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)  # float32 summation order differs


def _sample(ids, n_reply: int) -> Sample:
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.int8)
    mask[len(ids) - n_reply :] = 1
    return Sample(ids, mask, np.zeros(len(ids), dtype=np.float32))


def test_common_prefix_length() -> None:
    assert common_prefix_length([np.array([1, 2, 3, 4]), np.array([1, 2, 5]), np.array([1, 2, 3])]) == 2
    assert common_prefix_length([np.array([1, 2]), np.array([1, 2])]) == 2


def test_group_prompts_and_prompt_lengths() -> None:
    a, b, c = _sample([1, 2, 3, 9], 1), _sample([1, 2, 3, 8, 7], 2), _sample([1, 2, 4, 9], 1)
    no_sampled = Sample(np.array([5, 6, 7]), np.zeros(3), np.zeros(3))
    plen = prompt_lengths([a, b, c, no_sampled])
    assert plen == [3, 3, 3, 2]  # no sampled token: the last token is scored
    unique, inverse = group_prompts([s.token_ids for s in (a, b, c)], plen[:3])
    assert [u.tolist() for u in unique] == [[1, 2, 3], [1, 2, 4]] and inverse.tolist() == [0, 0, 1]


def test_shared_prefix_matches_full_forward_with_gradients(policy) -> None:
    from agents.rollout.runner import Runner

    records, _ = Runner(policy, "freshper/FrozenLake-v0", group_size=2, max_new_tokens=4, seed=5).collect(
        [21, 22], policy_version=0)
    samples = [s for r in records for s in r.samples][:24]
    plen = prompt_lengths(samples)
    unique, _ = group_prompts([s.token_ids for s in samples], plen)
    assert common_prefix_length(unique) >= 8  # the header pass is taken
    assert len(unique) < len(samples)  # rollouts of a map repeat prompts
    assert len({len(u) for u in unique}) > 1  # prompts of different lengths
    _assert_same_as_full_forward(policy, samples)


def test_duplicates_lengths_and_temperature(policy) -> None:
    """Hand-made batch: a shared header, prompts of different lengths, exact duplicates, one
    prompt that is a prefix of another, replies of 1 to 6 tokens."""
    rng = np.random.default_rng(0)
    vocab = len(policy.tokenizer)
    header = rng.integers(10, vocab, 20)
    p1 = np.concatenate([header, rng.integers(10, vocab, 7)])
    p2 = np.concatenate([header, rng.integers(10, vocab, 15)])
    p3 = p2[:-4]  # a prefix of p2
    samples = []
    for prompt, n in [(p1, 3), (p2, 1), (p1, 3), (p3, 6), (p2, 5), (p1, 2), (p3, 6)]:
        samples.append(_sample(np.concatenate([prompt, rng.integers(10, vocab, n)]), n))
    samples.append(samples[0])  # an identical sample twice
    _assert_same_as_full_forward(policy, samples)
    _assert_same_as_full_forward(policy, samples, temperature=0.7)


def test_short_prompts_without_header_and_single_sample(policy) -> None:
    rng = np.random.default_rng(1)
    vocab = len(policy.tokenizer)
    short = [_sample(rng.integers(10, vocab, n), k) for n, k in [(5, 2), (9, 4), (4, 1)]]
    assert common_prefix_length([s.token_ids for s in short]) < 8  # no header pass
    _assert_same_as_full_forward(policy, short)
    _assert_same_as_full_forward(policy, [_sample(rng.integers(10, vocab, 40), 5)])
    _assert_same_as_full_forward(policy, [_sample(rng.integers(10, vocab, 40), 1)])


def test_full_context_samples(policy) -> None:
    """Full-context records: several sampled segments with environment tokens between them."""
    from agents.rollout.runner import Runner

    records, _ = Runner(policy, "freshper/FrozenLake-v0", group_size=2, max_new_tokens=4, seed=3,
                        context="full").collect([31, 32], policy_version=0)
    samples = [s for r in records for s in r.samples]
    assert any(np.diff(np.asarray(s.loss_mask)).clip(min=0).sum() > 1 for s in samples)  # several segments
    _assert_same_as_full_forward(policy, samples)


@pytest.fixture(scope="module")
def vision_policy():
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    torch.manual_seed(0)
    return Policy.from_pretrained(build_tiny_model("vision"))


def _assert_vision_same_as_full_forward(policy, records, temperature: float = 1.0) -> None:
    samples = [s for r in records for s in r.samples if s.num_sampled]
    images = [[r.images[k] for k in s.image_ids] for r in records for s in r.samples if s.num_sampled]
    mask = _mask(samples)
    weights = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape) * mask
    policy.model.zero_grad(set_to_none=True)
    full = policy.token_logprobs(samples, images, temperature=temperature)
    torch.where(mask > 0, full * weights, torch.zeros_like(full)).sum().backward()
    g_full = [None if p.grad is None else p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)
    fast = sampled_logprobs(policy, samples, images, temperature=temperature)
    torch.where(mask > 0, fast * weights, torch.zeros_like(fast)).sum().backward()
    g_fast = [None if p.grad is None else p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)
    assert float(((fast - full).detach().abs() * mask).max()) < 1e-5
    # ... and both equal the behaviour log-probs the vision sampler recorded
    mu = _mask(samples) * 0
    for i, s in enumerate(samples):
        mu[i, : len(s.token_ids)] = torch.as_tensor(s.behavior_logprobs)
    if temperature == 1.0:
        assert float(((fast.detach() - mu).abs() * mask).max()) < 1e-4
    for a, b in zip(g_full, g_fast):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("context", ["window:0", "window:1"])
def test_vision_shared_prompts_match_full_forward_with_gradients(vision_policy, context) -> None:
    from agents.rollout.runner import Runner
    from learner.prompts import vision_applies

    records, _ = Runner(vision_policy, "freshper/FrozenLakeVision-v0", group_size=2, max_new_tokens=4, seed=5,
                        context=context, env_kwargs={"feedback": False}).collect([21, 22], policy_version=0)
    samples = [s for r in records for s in r.samples if s.num_sampled]
    assert vision_applies(vision_policy, samples)
    _assert_vision_same_as_full_forward(vision_policy, records)
    _assert_vision_same_as_full_forward(vision_policy, records, temperature=0.7)
    _assert_vision_same_as_full_forward(vision_policy, records[:1])  # one distinct prompt: no cache repeat


def test_vision_full_context_takes_the_full_forward(vision_policy) -> None:
    from agents.rollout.runner import Runner
    from learner.prompts import vision_applies

    records, _ = Runner(vision_policy, "freshper/FrozenLakeVision-v0", group_size=1, max_new_tokens=4, seed=5,
                        context="full").collect([23], policy_version=0)
    samples = [s for r in records for s in r.samples]
    if records[0].num_turns > 1:
        assert not vision_applies(vision_policy, samples)
    _assert_vision_same_as_full_forward(vision_policy, records)
