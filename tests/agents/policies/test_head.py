"""The fused LM head (agents/policies/head.py): log-probs and gradients equal the ordinary path
(the head's ``Linear``, then ``log_softmax(logits / T)[target]``), and the policy's scoring through
it equals the model's own forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.policies import head as head_module
from agents.policies.head import head_logprobs

pytest.importorskip("transformers")

SUPPRESSED = [3, 7]


def _ordinary(hidden, weight, targets, temperature, suppressed):
    logits = torch.nn.functional.linear(hidden, weight).float() / temperature
    logits[..., suppressed] = float("-inf")
    out = logits.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
    return torch.where(torch.isfinite(out), out, torch.zeros_like(out))


def _both(fn, hidden, weight, targets, weights, autocast: bool, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(h, w, targets, **kw)
    (out * weights).sum().backward()
    return out.detach(), h.grad, w.grad


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_ordinary_path(autocast, temperature, monkeypatch):
    monkeypatch.setattr(head_module, "BLOCK_ELEMENTS", 500 * 7)  # blocks of 7 rows: several, one partial
    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 9, 16), torch.randn(500, 16) * 0.3
    targets = torch.randint(0, 500, (4, 9))
    targets[1, 2] = SUPPRESSED[0]  # a suppressed target: 0, and no gradient through its row
    weights = torch.rand(4, 9)
    kw = {"temperature": temperature, "suppressed": SUPPRESSED}
    want = _both(_ordinary, hidden, weight, targets, weights, autocast, **kw)
    got = _both(head_logprobs, hidden, weight, targets, weights, autocast, **kw)
    assert got[0].dtype == torch.float32 and got[0][1, 2] == 0
    exact = {} if autocast else {"rtol": 1e-6, "atol": 1e-6}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **exact)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        torch.testing.assert_close(head_logprobs(hidden, weight, targets, **kw), want[0], **exact)


def test_a_frozen_head_gets_no_gradient_and_a_second_backward_is_refused():
    torch.manual_seed(1)
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(40, 8)
    out = head_logprobs(hidden, weight, torch.randint(0, 40, (5,)))
    out.sum().backward(retain_graph=True)
    assert hidden.grad is not None and weight.grad is None
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.sum().backward()


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    cache = tmp_path_factory.mktemp("tiny-cache")
    torch.set_num_threads(1)
    return {m: Policy.from_pretrained(build_tiny_model(m, cache_dir=cache)) for m in ("text", "vision")}


@pytest.mark.parametrize("modality", ["text", "vision"])
def test_the_policy_scores_through_the_fused_head_as_through_its_forward(policies, modality):
    """Scoring records of both embedded models (text: the shared-prefix passes; vision: the full
    forward with images) gives the values and gradients of the model's own forward."""
    from agents.rollout.runner import Runner
    from learner.prefix import sampled_logprobs

    policy = policies[modality]
    assert policy.fused_head
    task = "freshper/FrozenLake-v0" if modality == "text" else "freshper/FrozenLakeVision-v0"
    records, _ = Runner(policy, task, group_size=2, context="window:1", max_new_tokens=6, seed=3).collect(
        [0, 1], policy_version=0)
    samples = [s for r in records for s in r.samples]
    images = [[r.images[i] for i in s.image_ids] for r in records for s in r.samples]
    mask = torch.zeros(len(samples), max(len(s.token_ids) for s in samples))
    for i, s in enumerate(samples):
        mask[i, : len(s.token_ids)] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
    weights = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape) * mask

    def scored(fused: bool):
        policy._fusable_head = fused
        try:
            assert policy.fused_head is fused
            policy.model.zero_grad(set_to_none=True)
            lp = sampled_logprobs(policy, samples, images)
            (lp * weights).sum().backward()
            return lp.detach() * mask, {k: p.grad.clone() for k, p in policy.model.named_parameters()
                                        if p.grad is not None}
        finally:
            policy._fusable_head = True
            policy.model.zero_grad(set_to_none=True)

    (lp_fused, g_fused), (lp_plain, g_plain) = scored(True), scored(False)
    torch.testing.assert_close(lp_fused, lp_plain, rtol=0, atol=1e-6)
    assert g_fused.keys() == g_plain.keys() and any("embed" in k or "lm_head" in k for k in g_fused)
    for k in g_plain:
        torch.testing.assert_close(g_fused[k], g_plain[k], rtol=1e-4, atol=1e-6, msg=k)
    behaviour = np.concatenate([s.behavior_logprobs[s.loss_mask > 0] for s in samples])
    np.testing.assert_allclose(lp_fused[mask > 0].numpy(), behaviour, atol=1e-4)
