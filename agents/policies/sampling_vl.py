"""The vision-language sampler: the text sampler's loop for Qwen2-VL / Qwen2.5-VL (no HF ``generate``).

Per call: one prefill over the left-padded prompts with their images (``pixel_values``,
``image_grid_thw``) and explicit multimodal-rope positions, then one forward per new token with
the KV cache; each step samples from ``log_softmax(logits / T)`` in fp32 with the vision
special tokens removed (argmax when greedy) and records the chosen token's log-prob.

Positions are what HF computes for a fresh forward: ``model.model.get_rope_index`` over each
row's real tokens (3D positions for image tokens, 1D for text), and a new token's position is
the row's largest position + 1 + its step (HF's ``rope_deltas``). Passing them explicitly keeps
the model's cached ``rope_deltas`` out of the way. Work done once:

- identical prompts with identical images (a GRPO group's first turn) are prefilled once;
- the prompts' common prefix before the first vision token (the task instructions) is
  prefilled once, its cache repeated; only the rest goes through the vision tower and model.

Every row computes what it would compute alone, so the behaviour log-probs match
:meth:`Policy.token_logprobs` over the record (fp32, ~1e-6); finished rows leave the batch.
"""

from __future__ import annotations

import inspect
from typing import Protocol, Sequence

import numpy as np
import torch

from agents.record import Generation
from agents.policies.sampling import DecodingModel, _new_cache, common_prefix_length, decode_rows, expand_unique


class VisionDecodingModel(DecodingModel, Protocol):
    """What the vision sampler needs beyond the text one (:class:`agents.policies.policy.Policy` is one)."""

    suppressed_ids: list[int]  # the vision special tokens, never sampled

    def token_types(self, ids: torch.Tensor) -> torch.Tensor:
        """1 image pad, 2 video pad, 0 text."""

    def vision_inputs(self, images: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` for images in order."""

#: Architectures whose image inputs and rope this loop reproduces; others use HF ``generate``.
SUPPORTED = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")


def supports(model) -> bool:
    """Whether :func:`sample_vision` handles ``model`` (a known Qwen2-VL-family class)."""
    return type(model).__name__ in SUPPORTED and hasattr(getattr(model, "model", None), "get_rope_index")


def _image_key(image: np.ndarray) -> tuple:
    a = np.ascontiguousarray(image)
    return a.shape, str(a.dtype), a.tobytes()


def _rope_positions(policy: VisionDecodingModel, ids: torch.Tensor, mask: torch.Tensor, grid_thw) -> torch.Tensor:
    """[3, B, L] multimodal-rope positions of each row's real tokens (0 on padding)."""
    types = policy.token_types(ids)
    get_rope_index = policy.model.model.get_rope_index
    kwargs = {"image_grid_thw": grid_thw, "attention_mask": mask}
    if "mm_token_type_ids" in inspect.signature(get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = types
    positions, _ = get_rope_index(ids, **kwargs)
    return positions


@torch.inference_mode()
def sample_vision(
    policy: VisionDecodingModel,
    prompts: Sequence[Sequence[int]],
    images: Sequence[Sequence[np.ndarray]] | None,
    *,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
) -> list[Generation]:
    """Sample a reply for every prompt given its images in order; rows stop at EOS (kept)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be non-empty")
    images = list(images) if images is not None else [[] for _ in prompts]
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
    model, device = policy.model, policy.device
    cache_arg = policy.cache_arg
    unique: dict[tuple, int] = {}
    inverse = [unique.setdefault((tuple(int(t) for t in p), tuple(_image_key(im) for im in ims)), len(unique))
               for p, ims in zip(prompts, images)]
    first = {}
    for b, u in enumerate(inverse):
        first.setdefault(u, b)
    rows = [key[0] for key in unique]
    row_images = [im for u in range(len(rows)) for im in images[first[u]]]
    vision_ids = set(policy.suppressed_ids)
    before_vision = next((i for i, t in enumerate(rows[0]) if t in vision_ids), len(rows[0]))
    region = common_prefix_length(rows, limit=min(min(len(r) for r in rows) - 1, before_vision))
    width = max(len(r) for r in rows) - region
    full = torch.full((len(rows), region + width), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), region + width), dtype=torch.long)
    for u, r in enumerate(rows):
        full[u, :region] = torch.as_tensor(r[:region], dtype=torch.long)
        mask[u, :region] = 1
        full[u, region + width - (len(r) - region):] = torch.as_tensor(r[region:], dtype=torch.long)
        mask[u, region + width - (len(r) - region):] = 1
    full, mask = full.to(device), mask.to(device)
    vision = policy.vision_inputs(row_images)
    positions = _rope_positions(policy, full, mask, vision.get("image_grid_thw"))
    was_training = model.training
    model.eval()
    try:
        cache = _new_cache(model)
        if region:
            model(input_ids=full[:1, :region], position_ids=positions[:, :1, :region], use_cache=True,
                  logits_to_keep=1, **{cache_arg: cache})
            cache.batch_repeat_interleave(len(rows))
        out = model(input_ids=full[:, region:], attention_mask=mask, position_ids=positions[:, :, region:],
                    use_cache=True, logits_to_keep=1, **vision, **{cache_arg: cache})
        cache, logits, mask, index = expand_unique(out, mask, inverse)
        # Next token's position: the row's largest position + 1 (all three rope axes agree on text).
        position = (positions.amax(dim=(0, 2)) + 1)[index]
        # All three rope axes advance together on generated text.
        return decode_rows(policy, cache, logits, mask, position, max_new_tokens=max_new_tokens,
                           temperature=temperature, greedy=greedy,
                           position_ids=lambda pos: pos.view(1, -1, 1).expand(3, -1, -1))
    finally:
        model.train(was_training)
