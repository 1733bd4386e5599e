"""Packed shared-prefix ("tree") attention: each distinct prompt scored once, with no KV cache.

The shared-prefix passes of :mod:`learner.prefix` run a prompt once and its replies on its KV
cache. Under gradient checkpointing that cache cannot be used (a layer recomputed in the
backward pass would write it twice), so this module gets the same sharing from one plain
forward pass per *pack*: a single row holding

- the header shared by every distinct prompt of the pack (once),
- each distinct prompt's remainder after the header (once),
- each sample's reply (its tokens from the first sampled one on, the last one left out: no
  position predicts past it),

with a 4-D boolean attention mask in which a token sees, causally, the segments on its own path
of the tree (header -> prompt -> reply) and nothing else, and position ids that continue every
prompt after the header and every reply at its prompt's length. Each reply token then computes
exactly what it computes at its place in its own full sequence: values and gradients equal the
full forward pass up to float rounding (tested, also under checkpointing). The first token of a
reply is predicted by its prompt's last position, computed once for all the samples of that
prompt.

Only the predicting positions go through the LM head (``logits_to_keep`` as positions). A pack
holds at most :data:`PACK_TOKENS` tokens (one distinct prompt with more replies than that is
split over packs, its prompt repeated; a longer single sequence is a pack alone), so the
``L x L`` mask and the attention over it stay bounded: the attention of a pack is dense over its
length, which costs ``L`` per token where a sequence alone costs its own length.

Qwen2-VL-family models are packed the same way with their images: a distinct prompt is a
distinct (prompt, images) pair, its images go through the vision tower once per pack, its
multimodal-rope positions are the model's own ``get_rope_index`` of the prompt alone, the header
is the text before the first vision token, and a reply continues at its prompt's largest
position + 1, as the vision sampler generated it.

It needs an attention that takes a custom 4-D mask (``sdpa`` or ``eager``); other
implementations, other VLMs, samples with images after their first sampled token and the
sharded learner (a data-dependent number of model calls) take
:func:`learner.prefix.full_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from agents.policies.sampling import common_prefix_length
from learner.prompts import group_prompts, prompt_lengths, vision_applies

#: Most tokens of one pack (one forward pass). The attention of a pack is dense over its length:
#: at 1024 it adds at most ~12% to a 0.5B layer's per-token work.
PACK_TOKENS = 1024
#: Attention implementations that take a custom 4-D mask as given (``freshper_sdpa``:
#: :mod:`agents.policies.attention`, sdpa's masks).
MASKED_ATTENTION = ("sdpa", "eager", "freshper_sdpa")


def applies(policy) -> bool:
    """Whether ``policy`` can be scored by packed passes: a text or Qwen2-VL-family model whose
    attention takes a 4-D mask (a vision batch also needs :func:`vision_applies`)."""
    if policy.is_vision:
        from agents.policies import sampling_vl

        if not sampling_vl.supports(policy.model):
            return False
    return _attention(policy) in MASKED_ATTENTION


def _attention(policy) -> str | None:
    """The language model's attention implementation."""
    config = policy.model.config
    return getattr(config.get_text_config(), "_attn_implementation", None) or getattr(config, "_attn_implementation", None)


@dataclass
class _Pack:
    """One row: the header, then per distinct prompt its remainder and its samples' replies."""

    ids: list = field(default_factory=list)  # int arrays, concatenated in order
    positions: list = field(default_factory=list)  # [D, n] arrays (D = 1, or 3 for multimodal rope)
    segments: list = field(default_factory=list)  # per token, its segment
    parent: list = field(default_factory=list)  # per segment, its parent segment (-1: the root)
    prompts: list = field(default_factory=list)  # the distinct prompts in the pack, in order
    length: int = 0
    # per scored token: the packed index that predicts it, its target id, its (sample, column)
    predictor: list = field(default_factory=list)
    target: list = field(default_factory=list)
    row: list = field(default_factory=list)
    col: list = field(default_factory=list)

    def add(self, tokens: np.ndarray, positions: np.ndarray, parent: int) -> int:
        """Append a segment of ``tokens`` at ``positions`` ([D, n]); returns its packed offset."""
        seg = len(self.parent)
        self.parent.append(parent)
        offset = self.length
        self.ids.append(tokens)
        self.positions.append(positions)
        self.segments.append(np.full(len(tokens), seg))
        self.length += len(tokens)
        return offset


def _packs(ids: Sequence[np.ndarray], plen: Sequence[int], cap: int, unique: Sequence[np.ndarray],
           inverse: np.ndarray, positions: Sequence[np.ndarray], head: int) -> list[_Pack]:
    """The samples in packs of at most ``cap`` tokens (see the module docstring). ``unique``:
    the distinct prompts, ``inverse``: each sample's, ``positions``: each distinct prompt's
    ``[D, len]`` position ids (a reply continues at their largest + 1), ``head``: the length of
    the header all distinct prompts share (each keeps >= 1 token after it)."""
    ulen = [len(u) for u in unique]
    members: list[list[int]] = [[] for _ in unique]
    for b, u in enumerate(inverse):
        members[u].append(b)
    # units: (prompt, its samples), a prompt with too many replies split so each unit fits
    units: list[tuple[int, list[int]]] = []
    for u, bs in enumerate(members):
        part: list[int] = []
        cost = ulen[u] - head
        for b in bs:
            reply = len(ids[b]) - plen[b] - 1
            if part and head + cost + reply > cap:
                units.append((u, part))
                part, cost = [], ulen[u] - head
            part.append(b)
            cost += reply
        units.append((u, part))
    packs: list[_Pack] = []
    pack, root = None, -1
    for u, bs in units:
        size = ulen[u] - head + sum(len(ids[b]) - plen[b] - 1 for b in bs)
        if pack is None or (pack.length > head and pack.length + size > cap):
            pack = _Pack()
            packs.append(pack)
            root = -1
            if head:
                pack.add(unique[u][:head], positions[u][:, :head], -1)
                root = 0
        p_off = pack.add(unique[u][head:], positions[u][:, head:], root)
        pack.prompts.append(u)
        p_seg = len(pack.parent) - 1
        last = p_off + ulen[u] - head - 1  # predicts each reply's first token
        start = int(positions[u].max()) + 1
        for b in bs:
            x, p = ids[b], plen[b]
            steps = np.arange(start, start + len(x) - p - 1)
            r_off = pack.add(x[p:-1], np.broadcast_to(steps, (positions[u].shape[0], len(steps))), p_seg)
            for j in range(len(x) - p):
                pack.predictor.append(last if j == 0 else r_off + j - 1)
                pack.target.append(int(x[p + j]))
                pack.row.append(b)
                pack.col.append(p + j)
    return packs


def tree_mask(segments: np.ndarray, parent: Sequence[int]) -> torch.Tensor:
    """``[L, L]`` bool: token q sees token k when k's segment is q's own or one of its ancestors,
    and k comes no later than q (segments are laid out after their ancestors)."""
    n = len(parent)
    ancestor = np.eye(n, dtype=bool)
    for s in range(n):
        a = parent[s]
        while a >= 0:
            ancestor[s, a] = True
            a = parent[a]
    seg = torch.as_tensor(segments)
    visible = torch.as_tensor(ancestor)[seg[:, None], seg[None, :]]
    return torch.tril(visible)


def _text_prompts(ids, plen):
    """Distinct prompts, each sample's, their plain positions and the shared header's length."""

    unique, inverse = group_prompts(ids, plen)
    head = min(common_prefix_length(unique), min(len(u) for u in unique) - 1)
    return unique, inverse, [np.arange(len(u))[None] for u in unique], head, None


def _vision_prompts(policy, ids, plen, images):
    """Distinct (prompt, images) pairs, each sample's, their multimodal-rope positions (the
    model's own ``get_rope_index`` on the prompt alone), the header (text before the first
    vision token shared by all) and each distinct prompt's images."""
    from agents.policies.sampling_vl import _image_key, _rope_positions

    index: dict[tuple, int] = {}
    inverse = np.empty(len(ids), dtype=np.int64)
    unique, own_images = [], []
    for b, (x, p) in enumerate(zip(ids, plen)):
        key = (x[:p].tobytes(), tuple(_image_key(im) for im in images[b]))
        if key not in index:
            index[key] = len(unique)
            unique.append(x[:p])
            own_images.append(list(images[b]))
        inverse[b] = index[key]
    positions = []
    for u, ims in zip(unique, own_images):
        row = torch.as_tensor(u, device=policy.device)[None]
        grid = policy.vision_inputs(ims).get("image_grid_thw") if ims else None
        positions.append(_rope_positions(policy, row, torch.ones_like(row), grid)[:, 0].cpu().numpy())
    vision = set(policy.suppressed_ids)
    before_vision = next((i for i, t in enumerate(unique[0].tolist()) if t in vision), len(unique[0]))
    head = common_prefix_length(unique, limit=min(min(len(u) for u in unique) - 1, before_vision))
    return unique, inverse, positions, head, own_images


def packed_logprobs(policy, samples: Sequence, temperature: float = 1.0, cap: int | None = None,
                    images: Sequence | None = None) -> torch.Tensor:
    """``[B, T_max]`` log-probs of each sample's tokens from its first sampled one on (0 before),
    from packed passes (see the module docstring); differentiable. ``images``: per sample its
    images in order (a vision model)."""

    device = policy.device
    ids = [np.asarray(s.token_ids, dtype=np.int64) for s in samples]
    plen = prompt_lengths(samples)
    t_max = max(len(x) for x in ids)
    if policy.is_vision:
        unique, inverse, positions, head, own_images = _vision_prompts(
            policy, ids, plen, images if images is not None else [[] for _ in samples])
    else:
        unique, inverse, positions, head, own_images = _text_prompts(ids, plen)
    eager = _attention(policy) == "eager"
    rows, cols, parts = [], [], []
    for pack in _packs(ids, plen, cap or PACK_TOKENS, unique, inverse, positions, head):
        tokens = torch.as_tensor(np.concatenate(pack.ids), device=device)[None]
        pos = torch.as_tensor(np.concatenate(pack.positions, axis=1), device=device)[:, None]  # [D, 1, L]
        mask = tree_mask(np.concatenate(pack.segments), pack.parent).to(device)
        if eager:  # an additive mask
            mask = torch.zeros(mask.shape, device=device).masked_fill(~mask, torch.finfo(torch.float32).min)
        predictor = torch.as_tensor(pack.predictor, device=device)
        kw: dict = {}
        if own_images is not None:
            kw.update(policy.vision_inputs([im for u in pack.prompts for im in own_images[u]]))
            kw.update(policy._mm_types(tokens))
        else:
            pos = pos[0]
        if policy.takes_logits_to_keep:
            keep = torch.unique(predictor)  # sorted; the shared prompt ends appear once
            kw["logits_to_keep"] = keep
            predictor = torch.searchsorted(keep, predictor)
        features, _ = policy.scoring_forward(input_ids=tokens, attention_mask=mask[None, None], position_ids=pos,
                                             use_cache=False, **kw)
        parts.append(policy.features_logprobs(features[0].index_select(0, predictor),
                                              torch.as_tensor(pack.target, device=device), temperature))
        rows += pack.row
        cols += pack.col
    lp = torch.cat(parts)
    out = torch.zeros(len(samples), t_max, dtype=lp.dtype, device=device)
    return out.index_put((torch.as_tensor(rows, device=device), torch.as_tensor(cols, device=device)), lp)
