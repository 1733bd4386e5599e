"""Which tokens of a batch's samples are prompt and which prompts repeat: what the learner's
scoring paths (:mod:`learner.prefix`'s shared-prefix pass and :mod:`learner.packed`'s packed
passes) share."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def prompt_lengths(samples: Sequence) -> list[int]:
    """Per sample, the number of tokens before its first sampled (loss-mask) token, kept in
    ``[1, len - 1]`` so every sample has a prompt and at least one scored token."""
    out = []
    for s in samples:
        m = np.asarray(s.loss_mask) > 0
        n = len(s.token_ids)
        p = int(np.argmax(m)) if m.any() else n - 1
        out.append(max(1, min(p, n - 1)))
    return out


def group_prompts(ids: Sequence[np.ndarray], plen: Sequence[int]) -> tuple[list[np.ndarray], np.ndarray]:
    """Distinct prompts (in order of first appearance) and, per sample, its prompt's index."""
    index: dict[bytes, int] = {}
    unique: list[np.ndarray] = []
    inverse = np.empty(len(ids), dtype=np.int64)
    for b, (x, p) in enumerate(zip(ids, plen)):
        prompt = np.ascontiguousarray(np.asarray(x[:p], dtype=np.int64))
        key = prompt.tobytes()
        if key not in index:
            index[key] = len(unique)
            unique.append(prompt)
        inverse[b] = index[key]
    return unique, inverse


def vision_applies(policy, samples: Sequence) -> bool:
    """A Qwen2-VL-family model with no vision token after any sample's first sampled token (a
    ``full``-context sample whose later turns hold images takes the full forward)."""
    from agents.policies import sampling_vl

    if not sampling_vl.supports(policy.model):
        return False
    vision = np.asarray(policy.suppressed_ids, dtype=np.int64)
    return not any(np.isin(np.asarray(s.token_ids)[p:], vision).any() for s, p in zip(samples, prompt_lengths(samples)))
