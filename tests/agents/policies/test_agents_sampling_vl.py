"""The VLM sampler: images, multimodal rope, batching and finished rows change nothing but speed."""

from __future__ import annotations


import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from agents.policies import sampling_vl  # noqa: E402
from agents.policies.policy import Policy  # noqa: E402
from agents.record import Sample  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402
from conftest import build_tiny_qwen25vl, with_logit_bias  # noqa: E402

VISION = "freshper/FrozenLakeVision-v0"


@pytest.fixture(scope="module")
def vision_policy(tmp_path_factory):
    torch.set_num_threads(1)
    return Policy.from_pretrained(build_tiny_model("vision", cache_dir=tmp_path_factory.mktemp("tiny-cache")))


@pytest.fixture(scope="module")
def eos_prone_policy(vision_policy):
    """The tiny VLM with an EOS logit bias (rows finish at different steps) and a large
    ``<|image_pad|>`` bias (which must still never be sampled)."""
    image_pad = vision_policy.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return with_logit_bias(vision_policy, {vision_policy.eos_token_id: 4.0, image_pad: 20.0}, name="eos-prone")


@pytest.fixture(scope="module")
def qwen25vl_policy(tmp_path_factory):
    """A tiny randomly initialised model in the real Qwen2.5-VL checkpoint layout."""
    return Policy.from_pretrained(build_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl-sampling")))


def _cases(policy: Policy) -> tuple[list[list[int]], list[list[np.ndarray]]]:
    """Prompts of different lengths, images and image sizes: the same ids with a different
    image, a repeated prompt + image, two images in one prompt, a short prompt."""
    import envs

    env = envs.make(VISION)
    boards = [env.reset(seed=s)[0] for s in range(3)]
    chat = policy.chat
    a, b, c = ([o["image"]] for o in boards)
    inverted = [255 - boards[0]["image"]]
    half = [np.ascontiguousarray(boards[1]["image"][:56])]  # fewer visual tokens
    two = [boards[2]["image"], boards[0]["image"]]
    cases = [
        (chat.first_message(boards[0]["text"], a), a),
        (chat.first_message(boards[1]["text"], b), b),
        (chat.first_message(boards[0]["text"], a), inverted),
        (chat.first_message(boards[0]["text"], a), a),
        (chat.first_message(boards[1]["text"], half), half),
        (chat.first_message("Compare <image> and <image>.", two), two),
        (chat.first_message("Move. <image>", c), c),
    ]
    return [p for p, _ in cases], [ims for _, ims in cases]


def _check_logprobs(policy: Policy, prompts, images, gens) -> None:
    for p, ims, g in zip(prompts, images, gens):
        sample = Sample(list(p) + g.token_ids, [0] * len(p) + [1] * len(g.token_ids),
                        [0.0] * len(p) + g.logprobs, image_ids=list(range(len(ims))))
        with torch.no_grad():
            lp = policy.token_logprobs([sample], [ims])[0, len(p):]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4), (lp - torch.tensor(g.logprobs)).abs().max()


def test_known_qwen_vlms_take_the_hand_written_path(vision_policy, qwen25vl_policy):
    assert sampling_vl.supports(vision_policy.model) and sampling_vl.supports(qwen25vl_policy.model)


@pytest.mark.parametrize("greedy", [False, True])
def test_sampled_logprobs_match_a_fresh_forward_with_uneven_rows(eos_prone_policy, greedy):
    policy = eos_prone_policy
    prompts, images = _cases(policy)
    assert len({len(p) for p in prompts}) > 2
    torch.manual_seed(0)
    gens = policy.generate(prompts * 2, images * 2, max_new_tokens=10, greedy=greedy)
    assert len({len(g.token_ids) for g in gens}) > 1 or greedy  # rows finished at different steps
    for g in gens:
        assert g.finished == (g.token_ids[-1] == policy.eos_token_id)
        assert policy.eos_token_id not in g.token_ids[:-1]
        assert not set(g.token_ids) & set(policy.suppressed_ids)  # image tokens are never sampled
    _check_logprobs(policy, prompts * 2, images * 2, gens)


@pytest.mark.parametrize("which", ["qwen2_vl", "qwen2_5_vl"])
def test_greedy_is_argmax_and_batching_changes_nothing(vision_policy, qwen25vl_policy, which):
    policy = vision_policy if which == "qwen2_vl" else qwen25vl_policy
    prompts, images = _cases(policy)
    together = policy.generate(prompts, images, max_new_tokens=6, greedy=True)
    for p, ims, g in zip(prompts, images, together):
        alone = policy.generate([p], [ims], max_new_tokens=6, greedy=True)[0]
        assert alone.token_ids == g.token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(g.logprobs), atol=1e-5)
        with torch.no_grad():
            ids = torch.tensor([list(p) + g.token_ids])
            logits = policy.model(input_ids=ids, **policy.vision_inputs(ims), **policy._mm_types(ids)).logits
        assert logits[0, len(p) - 1: -1].argmax(-1).tolist() == g.token_ids
    _check_logprobs(policy, prompts, images, together)


def test_same_seed_same_samples(vision_policy):
    prompts, images = _cases(vision_policy)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append([(g.token_ids, g.logprobs) for g in vision_policy.generate(prompts, images, max_new_tokens=6)])
    assert runs[0] == runs[1]
    assert len({tuple(ids) for ids, _ in runs[0]}) > 1


def test_sampled_logprobs_match_a_fresh_forward_on_qwen2_5_vl(qwen25vl_policy):
    prompts, images = _cases(qwen25vl_policy)
    torch.manual_seed(0)
    gens = qwen25vl_policy.generate(prompts, images, max_new_tokens=8, temperature=0.7)
    for p, ims, g in zip(prompts, images, gens):
        sample = Sample(list(p) + g.token_ids, [0] * len(p) + [1] * len(g.token_ids),
                        [0.0] * len(p) + g.logprobs, image_ids=list(range(len(ims))))
        with torch.no_grad():
            lp = qwen25vl_policy.token_logprobs([sample], [ims], temperature=0.7)[0, len(p):]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-4)


def test_greedy_replies_equal_hf_generate(vision_policy, monkeypatch):
    """The HF ``generate`` fallback (other VLM architectures) gives the same greedy replies."""
    prompts, images = _cases(vision_policy)
    ours = vision_policy.generate(prompts, images, max_new_tokens=6, greedy=True)
    monkeypatch.setattr(sampling_vl, "supports", lambda model: False)
    theirs = vision_policy.generate(prompts, images, max_new_tokens=6, greedy=True)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_the_tiny_vlm_reads_images_at_flat_positions_and_keeps_them_in_checkpoints(vision_policy, qwen25vl_policy,
                                                                                   tmp_path):
    """The embedded VLM's decoder puts every token, visual ones included, at its plain index
    (``freshper_positions: flat``): HF's own forward equals a forward with explicit 1-D positions
    and differs from one at Qwen2-VL's multimodal positions; a saved checkpoint reloads with it;
    a model without the setting (a real checkpoint) keeps its own positions; an unknown layout
    is refused."""
    from agents.policies.policy import apply_position_layout, flat_rope_index

    policy = vision_policy
    assert policy.model.config.freshper_positions == "flat"
    prompts, images = _cases(policy)
    ids = torch.tensor([prompts[0]])
    vision = policy.processor.image_processor(images=images[0], return_tensors="pt")
    types = policy.token_types(ids)
    n_visual = int((ids == policy.image_token_id).sum())
    assert n_visual > 4
    kw = dict(pixel_values=vision["pixel_values"], image_grid_thw=vision["image_grid_thw"], mm_token_type_ids=types)
    inner = policy.model.model
    mrope, _ = type(inner).get_rope_index(inner, ids, image_grid_thw=vision["image_grid_thw"],
                                          attention_mask=torch.ones_like(ids), mm_token_type_ids=types)
    flat = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1)
    assert not torch.equal(mrope, flat)  # the image makes the two layouts differ
    with torch.no_grad():
        own = policy.model(input_ids=ids, **kw).logits
        at_flat = policy.model(input_ids=ids, position_ids=flat, **kw).logits
        at_mrope = policy.model(input_ids=ids, position_ids=mrope, **kw).logits
    assert torch.allclose(own, at_flat, atol=1e-5)
    assert (own - at_mrope).abs().max() > 1e-3
    assert torch.equal(flat_rope_index(ids)[0], flat)

    assert qwen25vl_policy.model.model.get_rope_index is not flat_rope_index
    reloaded = Policy.from_pretrained(policy.save_pretrained(tmp_path / "ckpt"))
    assert reloaded.model.model.get_rope_index is flat_rope_index
    reloaded.model.config.freshper_positions = "diagonal"
    with pytest.raises(ValueError, match="freshper_positions"):
        apply_position_layout(reloaded.model)
