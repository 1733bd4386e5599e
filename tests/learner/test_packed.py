"""Packed shared-prefix (tree) attention: each distinct prompt scored once without a KV cache,
equal to the full forward pass in values and gradients, also under gradient checkpointing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agents.record import Sample
from learner import packed
from learner.packed import packed_logprobs, tree_mask
from learner.prefix import sampled_logprobs, scoring_path
from learner.prompts import vision_applies


@pytest.fixture(scope="module")
def policy():
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    torch.manual_seed(0)
    return Policy.from_pretrained(build_tiny_model("text"))


def _sample(ids, n_reply: int) -> Sample:
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.int8)
    mask[len(ids) - n_reply:] = 1
    return Sample(ids, mask, np.zeros(len(ids), dtype=np.float32))


def _batch(policy, groups: int = 3, group_size: int = 3, header: int = 12, seed: int = 0) -> list[Sample]:
    """Groups of samples sharing a prompt, every prompt sharing a header; replies of 1-4 tokens."""
    rng = np.random.default_rng(seed)
    vocab = policy.model.config.vocab_size
    head = rng.integers(5, vocab, header)
    out = []
    for g in range(groups):
        body = rng.integers(5, vocab, 4 + g)
        for k in range(group_size):
            reply = rng.integers(5, vocab, 1 + (g + k) % 4)
            out.append(_sample(np.concatenate([head, body, reply]), len(reply)))
    return out


def _equal_to_the_full_pass(plain, scored, samples) -> torch.Tensor:
    """``scored``'s learner log-probs and gradients equal ``plain``'s full forward (same weights);
    the full pass's values on sampled positions."""
    full, g_full = _values_and_grads(plain, samples, lambda s: plain.token_logprobs(s))
    fast, g_fast = _values_and_grads(scored, samples, lambda s: sampled_logprobs(scored, s))
    torch.testing.assert_close(fast, full, rtol=0, atol=1e-5)
    for a, b in zip(g_full, g_fast):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    return full


def _values_and_grads(policy, samples, fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Log-probs on sampled positions and the parameter gradients of their weighted sum (a
    weight per position, so a wrong position or row cannot cancel out)."""
    mask = torch.zeros(len(samples), max(len(s.token_ids) for s in samples))
    for i, s in enumerate(samples):
        mask[i, : len(s.token_ids)] = torch.as_tensor(s.loss_mask, dtype=torch.float32)
    weights = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape) * mask
    policy.model.zero_grad(set_to_none=True)
    lp = fn(samples)
    assert lp.shape == mask.shape
    torch.where(mask > 0, lp * weights, torch.zeros_like(lp)).sum().backward()
    grads = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)
    return torch.where(mask > 0, lp, torch.zeros_like(lp)).detach(), grads


def _assert_equal_to_full_forward(policy, samples, **kw) -> None:
    full, g_full = _values_and_grads(policy, samples, lambda s: policy.token_logprobs(s, temperature=0.8))
    fast, g_fast = _values_and_grads(policy, samples, lambda s: packed_logprobs(policy, s, temperature=0.8, **kw))
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, full, rtol=0, atol=1e-5)
    for a, b in zip(g_full, g_fast):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)


def test_the_tree_mask_shows_each_token_its_own_path_causally() -> None:
    # header (seg 0: 2 tokens), prompt A (seg 1: 2), a reply of A (seg 2: 1), prompt B (seg 3: 1), a reply of B (seg 4: 2)
    segments = np.array([0, 0, 1, 1, 2, 3, 4, 4])
    m = tree_mask(segments, [-1, 0, 1, 0, 3]).int().tolist()
    assert m == [[1, 0, 0, 0, 0, 0, 0, 0],
                 [1, 1, 0, 0, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0, 0, 0, 0],
                 [1, 1, 1, 1, 0, 0, 0, 0],
                 [1, 1, 1, 1, 1, 0, 0, 0],
                 [1, 1, 0, 0, 0, 1, 0, 0],
                 [1, 1, 0, 0, 0, 1, 1, 0],
                 [1, 1, 0, 0, 0, 1, 1, 1]]


def test_packed_passes_equal_the_full_forward_with_gradients(policy) -> None:
    _assert_equal_to_full_forward(policy, _batch(policy))


def test_packs_cut_by_length_and_a_prompt_split_over_packs_stay_exact(policy) -> None:
    samples = _batch(policy, groups=2, group_size=5)
    ids = [np.asarray(s.token_ids) for s in samples]
    from learner.prefix import prompt_lengths

    plen = prompt_lengths(samples)
    unique, inverse, positions, head, _ = packed._text_prompts(ids, plen)
    packs = packed._packs(ids, plen, 22, unique, inverse, positions, head)
    assert len(packs) >= 3 and all(p.length <= 22 for p in packs)
    assert sorted(b for p in packs for b in set(p.row)) == list(range(len(samples)))  # every sample once
    _assert_equal_to_full_forward(policy, samples, cap=22)


def test_no_header_one_token_replies_and_a_single_sample(policy) -> None:
    a = _sample([7, 8, 9, 10, 11], 1)
    b = _sample([12, 8, 9, 13], 1)  # no common header with a
    c = _sample([7, 8, 9, 10, 11, 14, 15], 3)
    _assert_equal_to_full_forward(policy, [a, b, c])
    _assert_equal_to_full_forward(policy, [c])


def test_each_distinct_prompt_goes_through_the_model_once(policy) -> None:
    samples = _batch(policy, groups=3, group_size=4, header=12)
    seen = []
    hook = policy.model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    try:
        packed_logprobs(policy, samples)
    finally:
        hook.remove()
    bodies = 4 + 5 + 6
    replies = sum(int(s.loss_mask.sum()) - 1 for s in samples)
    assert seen == [12 + bodies + replies]  # one pass: the header once, each prompt once, the replies
    assert sum(seen) < sum(len(s.token_ids) for s in samples) / 2


def test_the_eager_attention_takes_the_additive_mask(policy) -> None:
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    eager = Policy.from_pretrained(build_tiny_model("text"))
    eager.model.set_attn_implementation("eager")
    assert packed.applies(eager)
    _assert_equal_to_full_forward(eager, _batch(eager, seed=1))


def test_under_gradient_checkpointing_the_learner_packs_and_matches_the_full_forward() -> None:
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    torch.manual_seed(0)
    plain = Policy.from_pretrained(build_tiny_model("text"))
    checkpointed = Policy.from_pretrained(build_tiny_model("text"))
    checkpointed.enable_gradient_checkpointing()
    samples = _batch(plain, groups=2, group_size=3)
    plain.model.train()
    checkpointed.model.train()
    assert scoring_path(plain) == "prefix" and scoring_path(checkpointed) == "packed"
    _equal_to_the_full_pass(plain, checkpointed, samples)
    checkpointed.model.eval()
    assert scoring_path(checkpointed) == "prefix"  # not training: the KV-cached passes
    checkpointed.sharded = True
    checkpointed.model.train()
    assert scoring_path(checkpointed) == "full"  # every rank must make the same number of calls


def _vision_policy(layout: str, checkpointing: bool):
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    policy = Policy.from_pretrained(build_tiny_model("vision"))
    if layout == "mrope":  # Qwen2-VL's own (t, h, w) positions instead of the tiny model's flat ones
        del policy.model.model.get_rope_index
        policy.model.config.freshper_positions = "mrope"
    if checkpointing:
        policy.enable_gradient_checkpointing()
    return policy


@pytest.mark.parametrize("layout", ["flat", "mrope"])
def test_vision_batches_pack_under_checkpointing_and_match_the_full_forward(layout: str) -> None:
    from agents.rollout.runner import Runner

    torch.manual_seed(0)
    plain, checkpointed = _vision_policy(layout, False), _vision_policy(layout, True)
    records, _ = Runner(plain, "freshper/FrozenLakeVision-v0", group_size=2, max_new_tokens=4, seed=5,
                        context="window:1", env_kwargs={"feedback": False}).collect([21, 22], policy_version=0)
    samples = [s for r in records for s in r.samples if s.num_sampled]
    images = [[r.images[k] for k in s.image_ids] for r in records for s in r.samples if s.num_sampled]
    assert len({bytes(np.asarray(s.token_ids)[:int(np.argmax(s.loss_mask))]) for s in samples}) < len(samples)
    plain.model.train()
    checkpointed.model.train()
    assert scoring_path(checkpointed) == "packed" and vision_applies(checkpointed, samples)
    full, g_full = _values_and_grads(plain, samples, lambda s: plain.token_logprobs(s, images, temperature=0.7))
    fast, g_fast = _values_and_grads(checkpointed, samples,
                                     lambda s: sampled_logprobs(checkpointed, s, images, temperature=0.7))
    torch.testing.assert_close(fast, full, rtol=0, atol=1e-5)
    for a, b in zip(g_full, g_fast):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    # a pack cut inside the batch: each pack's images go with it
    cut, _ = _values_and_grads(checkpointed, samples, lambda s: packed_logprobs(checkpointed, s, 0.7, cap=1,
                                                                                images=images))
    torch.testing.assert_close(cut, full, rtol=0, atol=1e-5)


def test_a_lora_update_with_its_kl_reference_packs_and_equals_the_kv_cached_path() -> None:
    """LoRA under checkpointing: the policy and its reference (the adapters off, same model, in
    training mode under no_grad) both take the packed passes; loss and adapter gradients equal
    the update without checkpointing (the KV-cached passes)."""
    from agents.policies.lora import LoraSettings, add_lora
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from learner.loss import LossSettings
    from agents.record import Trajectory
    from learner.update import AdapterReference, policy_update

    def make(checkpointing: bool) -> Policy:
        torch.manual_seed(0)
        policy = Policy.from_pretrained(build_tiny_model("text"))
        add_lora(policy, LoraSettings(rank=4))
        with torch.no_grad():  # non-zero B: the adapters change the outputs and A gets a gradient
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.1)
        if checkpointing:
            policy.enable_gradient_checkpointing()
        return policy

    results = []
    for checkpointing in (False, True):
        policy = make(checkpointing)
        samples = _batch(policy, groups=2, group_size=3)
        trajs = [Trajectory(env_id="t", seed=0, group_id=i // 3, turns=[], samples=[s], episode_return=0.0, success=False,
                            policy_version=0, advantage=float(a), images=[])
                 for i, (s, a) in enumerate(zip(samples, np.linspace(-1, 1, len(samples))))]
        calls = []
        original = packed.packed_logprobs
        packed.packed_logprobs = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            opt = torch.optim.SGD([p for p in policy.model.parameters() if p.requires_grad], lr=0.0)
            n = len(trajs)
            stats = policy_update(policy, AdapterReference(policy), opt, None, trajs, np.linspace(0.5, 1.5, n),
                                  np.arange(n, dtype=float), loss_cfg=LossSettings(kl_coef=0.1), on_policy=False,
                                  max_grad_norm=1e9)
        finally:
            packed.packed_logprobs = original
        assert len(calls) == (2 if checkpointing else 0)  # the policy's pass and the reference's
        grads = {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}
        assert grads and all("lora_" in k for k in grads)
        results.append((stats["loss"], stats.get("kl"), grads))
    (loss_a, kl_a, g_a), (loss_b, kl_b, g_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-6)
    assert kl_a > 0 and kl_b == pytest.approx(kl_a, rel=1e-4, abs=1e-7)  # the reference differs and agrees
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        torch.testing.assert_close(g_b[k], g_a[k], rtol=1e-4, atol=1e-6, msg=k)


def test_a_large_model_on_the_cpu_packs_a_batch_the_cached_passes_would_pad(policy, monkeypatch) -> None:
    """A large text model on the CPU packs a batch of short samples, and one where a later turn's
    long prompt among first turns would make the cached passes run every prompt at its length,
    with the same values and gradients; long samples whose counts are close, and small models,
    keep the cached passes."""
    import learner.prefix as prefix

    first_turns = _batch(policy, groups=3, group_size=3)
    rng = np.random.default_rng(1)
    history = np.concatenate([first_turns[0].token_ids, rng.integers(5, policy.model.config.vocab_size, 60)])
    mixed = first_turns + [_sample(np.concatenate([history, [7, 8]]), 2)]
    policy.model.train()
    assert scoring_path(policy, mixed) == "prefix"  # a small model: always the cached passes
    monkeypatch.setattr(prefix, "LARGE_MODEL_PARAMETERS", 1)  # as if the tiny model were a real one
    assert prefix.packing_pays(policy, mixed) and scoring_path(policy, mixed) == "packed"
    assert prefix.packing_pays(policy, first_turns)  # short samples: packed
    close = _batch(policy, groups=1, group_size=3, header=140)  # long samples, 157 tokens packed against 160 cached
    assert not prefix.packing_pays(policy, close) and scoring_path(policy, close) == "prefix"
    long_turns = _batch(policy, groups=3, group_size=3, header=140)
    long_history = np.concatenate([long_turns[0].token_ids, rng.integers(5, policy.model.config.vocab_size, 120)])
    assert not prefix.packing_pays(policy, long_turns)
    assert prefix.packing_pays(policy, long_turns + [_sample(np.concatenate([long_history, [7, 8]]), 2)])  # the padding
    assert scoring_path(policy) == "prefix"  # no batch to count
    full = _equal_to_the_full_pass(policy, policy, mixed)
    policy.model.eval()
    assert scoring_path(policy, mixed) == "packed"  # the KL reference scores the same way
    with torch.no_grad():
        torch.testing.assert_close(sampled_logprobs(policy, mixed) * (full != 0), full, rtol=0, atol=1e-5)
    calls = []
    monkeypatch.setattr(prefix.packed, "packed_logprobs", lambda *a, **kw: calls.append(1) or packed_logprobs(*a, **kw))
    sampled_logprobs(policy, mixed)
    assert calls  # the pack really ran
