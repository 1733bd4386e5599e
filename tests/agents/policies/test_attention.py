"""Short-query attention on the CPU (agents/policies/attention.py) equals PyTorch's
``scaled_dot_product_attention`` on the masks transformers builds, values and gradients, and the
policies take it without saving it into a checkpoint."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from agents.policies import attention  # noqa: E402


def _inputs(b, heads, kv_heads, q_len, k_len, dtype=torch.float32):
    g = torch.Generator().manual_seed(q_len * 100 + k_len)
    make = lambda h, n: torch.randn(b, h, n, 16, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return make(heads, q_len), make(kv_heads, k_len), make(kv_heads, k_len)


def _reference(q, k, v, mask, causal):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if mask is None and causal and q.shape[2] > 1:
        k, v = k[:, :, : q.shape[2]], v[:, :, : q.shape[2]]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                           is_causal=mask is None and causal and q.shape[2] > 1)
    return out.transpose(1, 2)


def _padded_mask(b, q_len, k_len):
    """A causal mask over a cache (queries at the end) with left padding in row 0, as transformers builds it."""
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)[None, None].repeat(b, 1, 1, 1)
    mask[0, :, :, :3] = False
    return mask


CASES = {
    "replies on a cache, padded": (4, 6, 3, 5, 20, "padded"),
    "a whole prompt, causal, no mask": (2, 6, 2, 12, 12, None),
    "one decoding step": (3, 6, 3, 1, 9, None),
    "an additive mask": (2, 4, 4, 7, 15, "additive"),
    "a long query (sdpa's kernel)": (1, 4, 2, attention.SHORT_QUERY + 8, attention.SHORT_QUERY + 8, "padded"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_short_attention_equals_sdpa_in_values_and_gradients(case):
    b, heads, kv_heads, q_len, k_len, kind = CASES[case]
    mask = None
    if kind is not None:
        mask = _padded_mask(b, q_len, k_len)
        if kind == "additive":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=heads // kv_heads)
    q, k, v = _inputs(b, heads, kv_heads, q_len, k_len)
    want = _reference(q, k, v, mask, True)
    weights = torch.rand(want.shape)
    (want * weights).sum().backward()
    want_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    got, none = attention.short_attention(module, q, k, v, mask)
    assert none is None and got.shape == want.shape
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, w in zip((q.grad, k.grad, v.grad), want_grads):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


def test_a_vision_tower_call_attends_everywhere():
    """The vision tower's calls are not causal and carry no mask: every patch sees every patch."""
    q, k, v = _inputs(1, 4, 4, 9, 9)
    got, _ = attention.short_attention(SimpleNamespace(is_causal=False), q, k, v, None, is_causal=False)
    torch.testing.assert_close(got, _reference(q, k, v, None, False))


def test_policies_use_it_and_checkpoints_do_not_name_it(tmp_path):
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    for modality in ("text", "vision"):
        policy = Policy.from_pretrained(build_tiny_model(modality, cache_dir=tmp_path / "cache"))
        assert policy.model.config._attn_implementation == attention.NAME
        saved = json.loads((policy.save_pretrained(tmp_path / modality) / "config.json").read_text())
        assert attention.NAME not in json.dumps(saved)
        back = Policy.from_pretrained(tmp_path / modality)
        assert back.model.config._attn_implementation == attention.NAME
