"""Attention for short queries on the CPU: plain matrix products where PyTorch's fused kernel is slow.

On the CPU, ``scaled_dot_product_attention`` runs a flash kernel whose cost is mostly a fixed
amount per (sequence, head) block. The learner's passes are made of exactly such calls: the
shared-prefix scoring (:mod:`learner.prefix`) runs each distinct prompt's remainder (~10-100
tokens) and then every sample's reply (~10-50 tokens, one row per sample) against a KV cache of
~100 positions, so a batch of 64 replies is 576 (row, head) blocks of a few hundred products
each. There the kernel's backward pass takes 5-9x its forward pass and ~20% of a real model's
update (``experiments/real_model/profile_update.py --profile``), while the same attention as two
matrix products and an fp32 softmax (what transformers' ``eager`` attention computes) takes a
fraction of it; for long queries (packed passes of ~1,000 tokens) the flash kernel is the faster
one. ``benchmarks/attention_bench.py`` measures both on the shapes of these passes.

:func:`install` registers ``freshper_sdpa`` with transformers' attention and mask registries and
switches a model that uses ``sdpa`` to it. Each call then takes the matrix products on the CPU
for queries of 2 to :data:`SHORT_QUERY` tokens (and scores of at most :data:`MAX_SCORES`
elements), and transformers' own ``sdpa`` function otherwise: on other devices, for one-token
queries (a decoding step, where transformers folds the grouped heads into one query and the
kernel is as fast), for long queries, and with any option the short path does not handle
(dropout, a position bias, soft-capping, attention weights asked for). The masks are ``sdpa``'s, so both paths see the
same ones, and so does :mod:`learner.packed`. The setting is not saved with the model: a saved
checkpoint names ``sdpa``.
"""

from __future__ import annotations

import torch

NAME = "freshper_sdpa"
#: Queries up to this many tokens take the matrix products on the CPU.
SHORT_QUERY = 128
#: ... and at most this many attention scores (batch x heads x queries x keys; 64 MB of fp32).
MAX_SCORES = 1 << 24


def short_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    is_causal=None, **kwargs):
    """transformers' attention-function signature: query [B, H, Q, D], key and value
    [B, H_kv, K, D], ``attention_mask`` None, boolean (True: attend) or additive, broadcast to
    [B, H, Q, K]; returns ([B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, q_len, dim = query.shape
    k_len = key.shape[2]
    if (query.device.type != "cpu" or q_len == 1 or q_len > SHORT_QUERY or b * heads * q_len * k_len > MAX_SCORES or dropout
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and q_len > 1:  # as sdpa's is_causal: queries align with the first keys
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        attention_mask = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
    scale = scaling if scaling is not None else dim ** -0.5
    # grouped-query attention: each key/value head serves `groups` query heads, which are folded
    # into its rows ([B, H_kv, G x Q, D]), so keys and values are used as they are, never repeated
    scores = torch.matmul(query.reshape(b, kv_heads, groups * q_len, dim), key.transpose(2, 3)) * scale
    scores = scores.view(b, kv_heads, groups, q_len, -1)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        mask = mask.unflatten(-3, (kv_heads, groups)) if mask.dim() == 4 and mask.shape[-3] == heads else \
            mask.unsqueeze(-3)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.view(b, kv_heads, groups * q_len, -1), value)
    return out.view(b, heads, q_len, dim).transpose(1, 2).contiguous(), None


def _registered() -> bool:
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError:  # a transformers without the registries: the model keeps sdpa
        return False
    AttentionInterface.register(NAME, short_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return True


def install(model) -> bool:
    """Switch ``model`` (and its sub-models) from ``sdpa`` to :func:`short_attention`; a model
    on another attention implementation is left as it is. Returns whether it was switched."""
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if current != "sdpa" or not _registered():
        return current == NAME
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, TypeError, AttributeError):  # a model that does not dispatch through the registry
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME
