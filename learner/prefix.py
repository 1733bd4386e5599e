"""Log-probs of many sequences that share a long common prefix, computing the prefix once.

In ``window:k`` context every training sequence starts with the same chat header and task
instructions (on FrozenLake about 60 of ~100 tokens). The prefix is run once with a KV cache,
the cache is repeated over the batch (``repeat_interleave`` is differentiable, so gradients
from every row flow back into the shared prefix), and only the suffixes are run. The result
equals a full forward pass on the sampled positions up to float rounding (tested), at a
fraction of the cost. Text models only; vision batches take the ordinary path.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import numpy as np
import torch

#: Below this shared length the ordinary full forward is used.
MIN_PREFIX = 8


def common_prefix_length(sequences: Sequence[np.ndarray]) -> int:
    """Length of the longest prefix shared by all sequences."""
    first = np.asarray(sequences[0])
    n = min(len(s) for s in sequences)
    if n == 0:
        return 0
    same = np.ones(n, dtype=bool)
    for s in sequences[1:]:
        same &= np.asarray(s[:n]) == first[:n]
    diff = np.flatnonzero(~same)
    return int(diff[0]) if diff.size else n


def sampled_logprobs(policy, samples: Sequence, images: Sequence | None = None, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T_max]`` log-probs of each sample's tokens, exact on sampled (loss-mask) positions.

    Positions inside the shared prefix are 0 (they are prompt tokens, never trained on).
    Falls back to ``policy.token_logprobs`` for vision models or a short shared prefix.
    """
    ids = [np.asarray(s.token_ids) for s in samples]
    prefix = common_prefix_length(ids)
    # Keep at least one token of every sample in the suffix and no sampled token in the prefix.
    first_sampled = min(int(np.argmax(np.asarray(s.loss_mask) > 0)) if np.asarray(s.loss_mask).any() else len(s.token_ids)
                        for s in samples)
    prefix = min(prefix, first_sampled, min(len(x) for x in ids) - 1)
    if policy.is_vision or prefix < MIN_PREFIX or len(samples) < 2:
        return policy.token_logprobs(samples, images if images is not None else [[] for _ in samples],
                                     temperature=temperature)
    model, device = policy.model, policy.device
    b = len(samples)
    t_max = max(len(x) for x in ids)
    s_len = t_max - prefix
    head = torch.as_tensor(ids[0][:prefix], dtype=torch.long, device=device)[None]
    out = model(input_ids=head, use_cache=True)
    # transformers >= 5.2x names the KV cache `cache`; older versions `past_key_values`.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = getattr(out, cache_arg)
    cache.batch_repeat_interleave(b)
    suffix = torch.full((b, s_len), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, t_max), dtype=torch.long)
    mask[:, :prefix] = 1
    for i, x in enumerate(ids):
        suffix[i, : len(x) - prefix] = torch.as_tensor(x[prefix:], dtype=torch.long)
        mask[i, prefix : len(x)] = 1
    suffix, mask = suffix.to(device), mask.to(device)
    positions = torch.arange(prefix, t_max, device=device)
    out2 = model(input_ids=suffix, attention_mask=mask, cache_position=positions,
                 position_ids=positions[None].expand(b, -1), use_cache=True, **{cache_arg: cache})
    logits = torch.cat([out.logits[:, -1:].expand(b, 1, -1), out2.logits[:, :-1]], dim=1).float() / temperature
    if policy.suppressed_ids:
        logits[..., policy.suppressed_ids] = float("-inf")
    lp = logits.gather(-1, suffix.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    lp = torch.where(mask[:, prefix:] > 0, lp, torch.zeros_like(lp))
    return torch.cat([torch.zeros(b, prefix, dtype=lp.dtype, device=device), lp], dim=1)
