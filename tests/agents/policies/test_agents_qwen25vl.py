"""The same loading path serves a real Qwen2.5-VL checkpoint layout (built tiny, locally)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from agents.policies.policy import Policy  # noqa: E402
from agents.record import Sample  # noqa: E402
from conftest import build_tiny_qwen25vl  # noqa: E402


@pytest.fixture(scope="module")
def qwen25vl_folder(tmp_path_factory):
    torch.set_num_threads(1)
    # A Qwen-like generation config that would distort sampling if it leaked through.
    return build_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl"), do_sample=True, top_k=1, top_p=0.8)


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
