"""Log-probs of many sequences that share prompts, computing every distinct prompt once.

In ``window:k`` context a batch is full of repeated prompts: all G rollouts of a map share the
turn-1 prompt, later turns revisit the same board with the same feedback, and every prompt
starts with the same chat header and task instructions (on FrozenLake ~60 of ~100 tokens),
while the trained replies are ~5 tokens. :func:`sampled_logprobs` therefore runs

1. the header shared by all prompts once (batch 1, KV cache);
2. each *distinct* prompt's remainder once, on that header's cache repeated over the distinct
   prompts (right-padded; the last real position gives the first reply token's logits);
3. the replies (everything from the first sampled token on), on the distinct prompts' caches
   gathered per sample with ``index_select``, at their true position ids, with an attention
   mask that hides the padding between a short prompt and the gathered cache's end.

``repeat_interleave`` and ``index_select`` are differentiable (their backward sums the rows),
so the gradient of every sample flows into the shared computation: values and gradients equal
a full forward pass on the sampled positions up to float rounding (tested). This is exact, not
an approximation.

Under gradient checkpointing a KV cache cannot be used (a recomputed layer would write it
twice), so the learner takes the packed passes of :mod:`learner.packed` instead: the same sharing
(header once, each distinct prompt once, the replies after it) in one plain forward per pack,
with a tree-shaped 4-D attention mask. A large text model on the CPU takes them too where they
cost less (:func:`packing_pays`: short samples, or many padding tokens). Where those do not apply
(VLMs other than the Qwen2-VL family, attention implementations without custom masks, the
sharded learner) it takes
:func:`full_logprobs`: one forward per sequence, with only the scored positions through the LM
head.
:func:`scoring_path` names the path; ``benchmarks/real_scale.py`` measures them.

Qwen2-VL-family models take the same three stages with their images: the header is what
precedes the first vision token, each distinct (prompt, images) pair goes through the vision
tower and the model once (left-padded, multimodal-rope positions from the model's own
``get_rope_index``), and reply tokens continue at the prompt's largest position + 1, exactly as
the vision sampler generated them. Samples whose replies are followed by further images
(``full`` context) and other VLMs take the ordinary full forward.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from agents.policies.precision import LARGE_MODEL_PARAMETERS
from agents.policies.sampling import common_prefix_length
from learner import packed
from learner.prompts import group_prompts, prompt_lengths, vision_applies

#: Below this shared length the header pass (stage 1) is skipped.
MIN_PREFIX = 8
#: A large text model on the CPU is scored by packed passes where its samples average at most
#: :data:`PACKED_SAMPLE_TOKENS` tokens or a pack runs at most :data:`PACKED_TOKEN_RATIO` of the
#: cached passes' tokens (:func:`packing_pays`).
PACKED_SAMPLE_TOKENS = 128
PACKED_TOKEN_RATIO = 0.8


def _select_rows(cache, rows: torch.Tensor) -> None:
    """Gather the cache's batch rows (``index_select``: differentiable, backward sums duplicates)."""
    layers = getattr(cache, "layers", None)
    if layers and all(hasattr(layer, "keys") for layer in layers):
        for layer in layers:
            if layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, rows)
                layer.values = layer.values.index_select(0, rows)
    else:  # other cache layouts: the library's own row selection
        cache.batch_select_indices(rows)


def sampled_logprobs(policy, samples: Sequence, images: Sequence | None = None, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T_max]`` log-probs of each sample's tokens, exact on sampled (loss-mask) positions.

    Positions before a sample's first sampled token are 0 (prompt tokens, never trained on);
    positions from it on hold the log-prob of that token given everything before it.
    Vision models take ``policy.token_logprobs`` (the full forward).
    """
    if not samples:
        return policy.token_logprobs(samples, [], temperature=temperature)
    images = images if images is not None else [[] for _ in samples]
    path = scoring_path(policy, samples)
    if path == "packed" and policy.is_vision:
        path = "packed" if vision_applies(policy, samples) else "full"
    if path == "full":
        return full_logprobs(policy, samples, images, temperature)
    with policy.autocast():
        if path == "packed":
            return packed.packed_logprobs(policy, samples, temperature, images=images)
        if policy.is_vision:
            if vision_applies(policy, samples):
                return _vision_logprobs(policy, samples, images, temperature)
            return policy.token_logprobs(samples, images, temperature=temperature)
        return _text_logprobs(policy, samples, temperature)


def scoring_path(policy, samples: Sequence | None = None) -> str:
    """How the learner scores a batch of ``policy``: ``prefix`` (the KV-cached shared-prefix
    passes of this module), ``packed`` (:mod:`learner.packed`: the same sharing without a
    cache) or ``full`` (:func:`full_logprobs`, each sequence whole).

    The cache is off under gradient checkpointing while training (a KV cache written inside a
    layer that is recomputed in the backward pass would be written twice) and always in a
    sharded learner (every rank must make the same number of model calls, so it takes ``full``);
    without the cache a model whose attention takes a 4-D mask is packed (a vision batch whose
    replies hold images takes ``full``: :func:`learner.prompts.vision_applies`).

    With ``samples``, a text model of :data:`~agents.policies.precision.LARGE_MODEL_PARAMETERS`
    or more parameters on the CPU is packed too where that pays (:func:`packing_pays`: short
    samples, or many padding tokens)."""
    if getattr(policy, "sharded", False):
        return "full"
    if policy.gradient_checkpointing and policy.model.training:
        return "packed" if packed.applies(policy) else "full"
    if samples is not None and packing_pays(policy, samples):
        return "packed"
    return "prefix"


def packing_pays(policy, samples: Sequence) -> bool:
    """Whether packed passes score ``samples`` of ``policy`` for less than the cached ones: a
    text model of :data:`~agents.policies.precision.LARGE_MODEL_PARAMETERS` or more parameters
    on the CPU whose attention takes a 4-D mask, and a batch of short samples (at most
    :data:`PACKED_SAMPLE_TOKENS` tokens on average) or one where a pack would run at most
    :data:`PACKED_TOKEN_RATIO` of the tokens the cached passes run. The cached passes make three
    model calls, gather the prompts' caches per sample and run every distinct prompt
    right-padded to the longest (one later turn's prompt among first turns makes every prompt
    run at its length); a pack runs each distinct token once in one call, but its attention is
    dense over its length, which long multi-turn samples with little sharing pay for. Small
    models keep the cached passes always; the measurements behind the rule are in
    docs/results/real_model.md#the-scoring-path."""
    if policy.is_vision or policy.device.type != "cpu" \
            or policy.num_parameters < LARGE_MODEL_PARAMETERS or not packed.applies(policy):
        return False
    if sum(len(s.token_ids) for s in samples) <= PACKED_SAMPLE_TOKENS * len(samples):
        return True  # short samples: no need to count the two paths' tokens
    cached, in_pack = scored_tokens(samples)
    return in_pack <= PACKED_TOKEN_RATIO * cached


def scored_tokens(samples: Sequence) -> tuple[int, int]:
    """The tokens the model runs for ``samples``: in the cached passes (the header, every
    distinct prompt's remainder padded to the longest, every reply but its last token padded to
    the longest) and in one pack (each distinct token once)."""
    ids = [np.asarray(s.token_ids) for s in samples]
    plen = prompt_lengths(samples)
    unique, _ = group_prompts(ids, plen)
    ulen = [len(u) for u in unique]
    head = min(common_prefix_length(unique), min(ulen) - 1)
    head = head if head >= MIN_PREFIX else 0
    replies = [len(x) - p for x, p in zip(ids, plen)]
    cached = head + len(unique) * (max(ulen) - head) + len(ids) * (max(replies) - 1)
    return cached, head + sum(n - head for n in ulen) + sum(r - 1 for r in replies)


def full_logprobs(policy, samples: Sequence, images: Sequence, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T_max]`` log-probs of each token from the batch's first sampled position on, in one
    forward pass over the right-padded sequences (no KV cache); 0 before that position.

    Only the positions from the earliest first-sampled token on go through the LM head
    (``logits_to_keep``), so a batch of long prompts with short replies costs the LM head and
    the log-softmax of the replies alone.
    """
    device = policy.device
    lengths = [len(s.token_ids) for s in samples]
    t_max = max(lengths)
    ids = torch.full((len(samples), t_max), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(samples), t_max), dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : lengths[b]] = torch.as_tensor(np.asarray(s.token_ids), dtype=torch.long)
        mask[b, : lengths[b]] = 1
    ids, mask = ids.to(device), mask.to(device)
    first = min(prompt_lengths(samples))  # the earliest position scored
    kwargs: dict = {}
    if policy.is_vision:
        flat = [im for per in images for im in per]
        kwargs = {**policy.vision_inputs(flat), **policy._mm_types(ids)}
    if policy.takes_logits_to_keep:  # as positions, not a count: the kept hidden states come out contiguous,
        # and the LM head is one matmul (a strided slice made the CPU copy the head's weight per row)
        kwargs["logits_to_keep"] = torch.arange(first - 1, t_max, device=device)
    with policy.autocast():
        features, _ = policy.scoring_forward(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs)
        features = features[:, -(t_max - first + 1):]  # positions first-1 .. t_max-1
        lp = policy.features_logprobs(features[:, :-1], ids[:, first:], temperature) * mask[:, first:]
    return torch.cat([torch.zeros(len(samples), first, dtype=lp.dtype, device=device), lp], dim=1)


def _text_logprobs(policy, samples: Sequence, temperature: float) -> torch.Tensor:
    """The three shared-prefix stages for a text model (see the module docstring)."""
    device = policy.device
    cache_arg, logits_to_keep = policy.cache_arg, policy.takes_logits_to_keep
    ids = [np.asarray(s.token_ids, dtype=np.int64) for s in samples]
    b = len(ids)
    t_max = max(len(x) for x in ids)
    plen = prompt_lengths(samples)
    unique, inverse = group_prompts(ids, plen)
    u = len(unique)
    ulen = [len(x) for x in unique]

    # 1. the header shared by every distinct prompt, once (each prompt keeps >= 1 token after it)
    head_len = min(common_prefix_length(unique), min(ulen) - 1)
    cache = None
    if head_len >= MIN_PREFIX:
        head = torch.as_tensor(unique[0][:head_len], device=device)[None]
        kw = {"logits_to_keep": 1} if logits_to_keep else {}
        cache = getattr(policy.scoring_forward(input_ids=head, use_cache=True, **kw)[1], cache_arg)
        if u > 1:
            cache.batch_repeat_interleave(u)
    else:
        head_len = 0

    # 2. each distinct prompt's remainder once, right-padded; logits at its last real position
    rest = max(ulen) - head_len
    prompt_ids = torch.full((u, rest), policy.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((u, head_len + rest), dtype=torch.long)
    prompt_mask[:, :head_len] = 1
    for i, x in enumerate(unique):
        prompt_ids[i, : len(x) - head_len] = torch.as_tensor(x[head_len:])
        prompt_mask[i, head_len : len(x)] = 1
    last = torch.as_tensor([n - head_len - 1 for n in ulen], dtype=torch.long)
    positions = torch.arange(head_len, head_len + rest, device=device)
    kw = {}
    if logits_to_keep:
        keep = torch.unique(last)  # sorted distinct positions: only these go through the LM head
        kw["logits_to_keep"] = keep.to(device)
        last = torch.searchsorted(keep, last)
    if cache is not None:
        kw[cache_arg] = cache
    features, out = policy.scoring_forward(input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device),
                                           position_ids=positions[None].expand(u, -1), cache_position=positions,
                                           use_cache=True, **kw)
    first = features[torch.arange(u), last.to(device)]  # [U, H or V]: predicts each reply's first token
    first = first.index_select(0, torch.as_tensor(inverse, device=device))  # [B, H or V]

    # 3. the replies, on the prompts' caches gathered per sample, at their true positions
    slen, s_max, suffix = _replies(ids, plen, policy.pad_token_id, device)
    if s_max > 1:
        cache = getattr(out, cache_arg)
        _select_rows(cache, torch.as_tensor(inverse, device=device))
        width = head_len + rest
        mask = torch.zeros((b, width + s_max - 1), dtype=torch.long)
        for i, (p, s) in enumerate(zip(plen, slen)):
            mask[i, :p] = 1  # the prompt's slots (its padding up to `width` stays hidden)
            mask[i, width : width + s - 1] = 1
        pos = torch.as_tensor(plen, dtype=torch.long)[:, None] + torch.arange(s_max - 1)[None]
        rest_features, _ = policy.scoring_forward(
            input_ids=suffix[:, :-1], attention_mask=mask.to(device), position_ids=pos.to(device),
            cache_position=torch.arange(width, width + s_max - 1, device=device), use_cache=True, **{cache_arg: cache})
        features = torch.cat([first[:, None], rest_features], dim=1)  # [B, S, H or V]
    else:
        features = first[:, None]
    return _place(policy.features_logprobs(features, suffix, temperature), plen, slen, t_max)


def _replies(ids: Sequence[np.ndarray], plen: Sequence[int], pad: int, device) -> tuple[list[int], int, torch.Tensor]:
    """Each sample's tokens from its first sampled one on, right-padded: lengths, width, ids."""
    slen = [len(x) - p for x, p in zip(ids, plen)]
    s_max = max(slen)
    suffix = torch.full((len(ids), s_max), pad, dtype=torch.long)
    for i, (x, p) in enumerate(zip(ids, plen)):
        suffix[i, : len(x) - p] = torch.as_tensor(x[p:])
    return slen, s_max, suffix.to(device)


def _place(lp: torch.Tensor, plen: Sequence[int], slen: Sequence[int], t_max: int) -> torch.Tensor:
    """Row b's first ``slen[b]`` reply log-probs at columns ``plen[b]..`` of a ``[B, t_max]`` zero
    tensor (a scatter into zeros: differentiable)."""
    b, s_max = lp.shape
    device = lp.device
    valid = torch.arange(s_max, device=device)[None] < torch.as_tensor(slen, device=device)[:, None]
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    cols = (torch.as_tensor(plen, dtype=torch.long)[:, None] + torch.arange(s_max)[None]).to(device)
    full = torch.zeros(b, t_max + s_max, dtype=lp.dtype, device=device).scatter(1, cols, lp)
    return full[:, :t_max]


def _vision_logprobs(policy, samples: Sequence, images: Sequence, temperature: float) -> torch.Tensor:
    """The three stages for a Qwen2-VL-family model (see the module docstring)."""
    from transformers import DynamicCache

    from agents.policies.sampling_vl import _image_key, _rope_positions

    model, device, cache_arg = policy.model, policy.device, policy.cache_arg
    ids = [np.asarray(s.token_ids, dtype=np.int64) for s in samples]
    b, t_max = len(ids), max(len(x) for x in ids)
    plen = prompt_lengths(samples)
    index: dict[tuple, int] = {}
    inverse = np.empty(b, dtype=np.int64)
    rows: list[np.ndarray] = []
    row_images: list[np.ndarray] = []
    for i, (x, p) in enumerate(zip(ids, plen)):
        key = (x[:p].tobytes(), tuple(_image_key(im) for im in images[i]))
        if key not in index:
            index[key] = len(rows)
            rows.append(x[:p])
            row_images.extend(images[i])
        inverse[i] = index[key]
    u = len(rows)
    vision_ids = set(policy.suppressed_ids)
    before_vision = next((i for i, t in enumerate(rows[0].tolist()) if t in vision_ids), len(rows[0]))
    region = common_prefix_length(rows, limit=min(min(len(r) for r in rows) - 1, before_vision))
    region = region if region >= MIN_PREFIX else 0
    width = max(len(r) for r in rows) - region
    full = torch.full((u, region + width), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((u, region + width), dtype=torch.long)
    for k, r in enumerate(rows):  # the header left-aligned, each remainder right-aligned (left padding)
        full[k, :region] = torch.as_tensor(r[:region])
        mask[k, :region] = 1
        full[k, region + width - (len(r) - region):] = torch.as_tensor(r[region:])
        mask[k, region + width - (len(r) - region):] = 1
    full, mask = full.to(device), mask.to(device)
    vision = policy.vision_inputs(row_images)
    positions = _rope_positions(policy, full, mask, vision.get("image_grid_thw"))  # [3, U, W]

    # 1. the header, once; 2. each distinct prompt with its images, once
    cache = DynamicCache(config=model.config)  # a plain cache: its tensors are never written in place
    if region:
        policy.scoring_forward(input_ids=full[:1, :region], position_ids=positions[:, :1, :region], use_cache=True,
                               logits_to_keep=1, **{cache_arg: cache})
        if u > 1:
            cache.batch_repeat_interleave(u)
    features, out = policy.scoring_forward(input_ids=full[:, region:], attention_mask=mask,
                                           position_ids=positions[:, :, region:], use_cache=True, logits_to_keep=1,
                                           **vision, **{cache_arg: cache})
    rows_t = torch.as_tensor(inverse, device=device)
    first = features[:, -1].index_select(0, rows_t)  # [B, H or V]: each reply's first token

    # 3. the replies on the gathered caches, continuing at the prompt's largest position + 1
    slen, s_max, suffix = _replies(ids, plen, policy.pad_token_id, device)
    if s_max > 1:
        cache = getattr(out, cache_arg)
        _select_rows(cache, rows_t)
        reply_mask = (torch.arange(s_max - 1)[None] < torch.as_tensor(slen)[:, None] - 1).long().to(device)
        attn = torch.cat([mask.index_select(0, rows_t), reply_mask], dim=1)
        start = (positions.amax(dim=(0, 2)) + 1).index_select(0, rows_t)  # [B]
        pos = (start[:, None] + torch.arange(s_max - 1, device=device)[None])[None].expand(3, -1, -1)
        rest_features, _ = policy.scoring_forward(input_ids=suffix[:, :-1], attention_mask=attn, position_ids=pos,
                                                  use_cache=True, **{cache_arg: cache})
        features = torch.cat([first[:, None], rest_features], dim=1)
    else:
        features = first[:, None]
    return _place(policy.features_logprobs(features, suffix, temperature), plen, slen, t_max)
