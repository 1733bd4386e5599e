"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest


def build_tiny_qwen25vl(folder: Path, **generation_config) -> Path:
    """Save a tiny randomly initialised model in the real Qwen2.5-VL checkpoint layout (model,
    tokenizer, Qwen2.5-VL processor) to ``folder``; ``generation_config`` items are set on the
    saved model's generation config (e.g. a distorting top_k)."""
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor)

    from agents.tiny import CHAT_TEMPLATE, _train_tokenizer

    corpus = "<answer>Up</answer> <answer>Down</answer> FrozenLake move the player to the goal\n" * 20
    tok = _train_tokenizer(corpus, 300)
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
                         bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    for key, value in generation_config.items():
        setattr(model.generation_config, key, value)
    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except ImportError:
        video = None
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
                        tokenizer=tok, video_processor=video, chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def with_logit_bias(policy, biases: dict[int, float], name: str = "biased"):
    """A copy of ``policy`` whose LM head adds ``biases[token_id]`` to those tokens' logits
    (e.g. an EOS bias, so rows of a batch finish at different steps)."""
    import copy

    import torch

    from agents.policy import Policy

    model = copy.deepcopy(policy.model)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        for token, bias in biases.items():
            head.bias[token] = bias
    model.lm_head = head
    return Policy(model, policy.tokenizer, policy.processor, name=name)


@pytest.fixture(scope="module")
def search_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ``FRESHPER_CACHE`` at a temporary folder, so generated corpora, indices and tiny
    models stay out of the working tree."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("freshper-cache")
    mp.setenv("FRESHPER_CACHE", str(root))
    yield root
    mp.undo()
