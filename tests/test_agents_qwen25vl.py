"""The same loading path serves a real Qwen2.5-VL checkpoint layout (built tiny, locally)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from agents.policy import Policy  # noqa: E402
from agents.record import Sample  # noqa: E402
from agents.tiny import CHAT_TEMPLATE, _train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def qwen25vl_folder(tmp_path_factory):
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLImageProcessor)

    torch.set_num_threads(1)
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
    # A Qwen-like generation config that would distort sampling if it leaked through.
    model.generation_config.do_sample = True
    model.generation_config.top_k = 1
    model.generation_config.top_p = 0.8
    folder = tmp_path_factory.mktemp("qwen25vl")
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    try:
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except ImportError:
        video = None
    Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video,
                        chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    tok.save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def test_qwen2_5_vl_layout_loads_generates_and_scores(qwen25vl_folder):
    import envs

    policy = Policy.from_pretrained(qwen25vl_folder)
    assert policy.is_vision and type(policy.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    env = envs.make("freshper/FrozenLakeVision-v0")
    obs, _ = env.reset(seed=0)
    prompt = policy.chat.first_message(obs["text"], [obs["image"]])
    torch.manual_seed(0)
    gens = policy.generate([prompt, prompt[:]], [[obs["image"]], [obs["image"]]], max_new_tokens=5)
    for g in gens:
        sample = Sample(prompt + g.token_ids, [0] * len(prompt) + [1] * len(g.token_ids),
                        [0.0] * len(prompt) + g.logprobs, image_ids=[0])
        with torch.no_grad():
            lp = policy.token_logprobs([sample], [[obs["image"]]])[0, len(prompt):]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4)
