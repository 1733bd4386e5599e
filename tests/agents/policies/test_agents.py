"""Agents: exact episode tokenization, log-prob reproduction, VLM image use, real layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from agents.policies.policy import Policy  # noqa: E402
from agents.record import Sample, load_records, save_records  # noqa: E402
from agents.rollout.runner import Runner  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402

TEXT = "freshper/FrozenLake-v0"
VISION = "freshper/FrozenLakeVision-v0"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="module")
def text_policy(cache):
    torch.set_num_threads(1)  # 2 spinning threads on 2 shared cores are ~40x slower here
    return Policy.from_pretrained(build_tiny_model("text", cache_dir=cache))


@pytest.fixture(scope="module")
def vision_policy(cache):
    return Policy.from_pretrained(build_tiny_model("vision", cache_dir=cache))


def _masked_runs(sample: Sample) -> list[list[int]]:
    runs, cur = [], []
    for tok, m in zip(sample.token_ids.tolist(), sample.loss_mask.tolist()):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def _check_record_exact(policy: Policy, rec) -> None:
    """Recomputed log-probs match behaviour log-probs; masked tokens decode to the replies."""
    images = [[rec.images[i] for i in s.image_ids] for s in rec.samples]
    with torch.no_grad():
        lp = policy.token_logprobs(rec.samples, images)
    for b, s in enumerate(rec.samples):
        mask = torch.as_tensor(s.loss_mask, dtype=torch.bool)
        got = lp[b, : len(s.token_ids)][mask]
        want = torch.as_tensor(s.behavior_logprobs)[mask]
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert np.all(s.behavior_logprobs[~mask.numpy()] == 0)
    runs = [r for s in rec.samples for r in (_masked_runs(s) if rec.context == "full" else [_masked_runs(s)[-1]])]
    assert [policy.reply_text(r) for r in runs] == [t.reply for t in rec.turns]


def test_tiny_model_is_cached_and_rebuilt_when_incomplete(cache, text_policy):
    path = build_tiny_model("text", cache_dir=cache)
    assert build_tiny_model("text", cache_dir=cache) == path
    (path / "freshper_tiny.json").unlink()
    assert build_tiny_model("text", cache_dir=cache) == path and (path / "freshper_tiny.json").exists()
    tok = text_policy.tokenizer
    for t in ["<answer>", "</answer>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"]:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    n_params = sum(p.numel() for p in text_policy.model.parameters())
    assert 0.5e6 < n_params < 2e6


@pytest.mark.parametrize("context", ["window:0", "window:2", "full"])
def test_text_records_reproduce_logprobs_and_replies(text_policy, context):
    runner = Runner(text_policy, TEXT, group_size=2, context=context, max_new_tokens=6, seed=1)
    records, stats = runner.collect([0, 1], policy_version=3)
    assert stats["episodes"] == 4 and stats["turns"] > 0
    assert all(r.policy_version == 3 and r.context == context for r in records)
    assert {r.group_id for r in records[:2]} != {r.group_id for r in records[2:]}
    for rec in records:
        assert len(rec.samples) == (1 if context == "full" else rec.num_turns)
        _check_record_exact(text_policy, rec)


def test_full_context_never_retokenizes(text_policy):
    """The full-mode sequence is the concatenation of first message, replies and new messages."""
    runner = Runner(text_policy, TEXT, group_size=1, context="full", max_new_tokens=6)
    rec = runner.collect([5], policy_version=0)[0][0]
    chat = text_policy.chat
    expect = chat.first_message(rec.turns[0].observation)
    runs = _masked_runs(rec.samples[0])
    for j, turn in enumerate(rec.turns):
        if j:
            closed = runs[j - 1][-1] == text_policy.eos_token_id
            expect += ([] if closed else [text_policy.eos_token_id]) + chat.next_message(turn.observation)
        expect += runs[j]
    assert rec.samples[0].token_ids.tolist() == expect


def test_vision_records_reproduce_logprobs_and_replies(vision_policy, tmp_path):
    runner = Runner(vision_policy, VISION, group_size=2, context="window:0", max_new_tokens=6)
    records, _ = runner.collect([0], policy_version=1)
    for rec in records:
        assert rec.images and all(t.image_index is not None for t in rec.turns)
        _check_record_exact(vision_policy, rec)
    save_records(records, tmp_path)
    back = load_records(tmp_path)
    for a, b in zip(records, back):
        assert a.turns == b.turns and a.episode_return == b.episode_return
        assert all(np.array_equal(x, y) for x, y in zip(a.images, b.images))
        for sa, sb in zip(a.samples, b.samples):
            assert np.array_equal(sa.token_ids, sb.token_ids)
            assert np.array_equal(sa.behavior_logprobs, sb.behavior_logprobs)
            assert sa.image_ids == sb.image_ids


def test_vlm_logits_depend_on_the_image(vision_policy):
    import envs

    env = envs.make(VISION)
    obs, _ = env.reset(seed=0)
    image = obs["image"]
    ids = vision_policy.chat.first_message(obs["text"], [image])
    sample = Sample(ids, [0] * len(ids), [0.0] * len(ids), image_ids=[0])
    with torch.no_grad():
        a = vision_policy.token_logprobs([sample], [[image]])
        b = vision_policy.token_logprobs([sample], [[255 - image]])
        a2 = vision_policy.token_logprobs([sample], [[image]])
    assert torch.equal(a, a2)  # deterministic image processing
    assert (a - b).abs().max() > 1e-3


def test_context_budget_truncates_cleanly(text_policy):
    budget = 260
    runner = Runner(text_policy, TEXT, group_size=2, context="full", max_new_tokens=8, max_context_tokens=budget)
    records, stats = runner.collect([0], policy_version=0)
    assert stats["truncated"] == 2
    for rec in records:
        assert rec.truncated and rec.info["end_reason"] == "context budget"
        assert len(rec.samples[0].token_ids) <= budget
        assert rec.samples[0].loss_mask[-1] == 1  # ends on a whole reply, not mid-message
        _check_record_exact(text_policy, rec)


def test_scripted_replies_are_recorded_with_zero_logprobs(text_policy):
    def reply_fn(obs, info, env):
        return type(env.unwrapped).format_reply(env.unwrapped.legal_actions()[0])

    runner = Runner(text_policy, TEXT, group_size=2, context="window:0")
    records, stats = runner.collect([0, 1], policy_version=0, reply_fn=reply_fn)
    assert stats["invalid_reply_rate"] == 0.0
    for rec in records:
        for sample, turn in zip(rec.samples, rec.turns):
            assert turn.reply.startswith("<answer>") and turn.action_is_valid
            reply_ids = _masked_runs(sample)[-1]
            assert text_policy.reply_text(reply_ids) == turn.reply and reply_ids[-1] == text_policy.eos_token_id
            assert np.all(sample.behavior_logprobs == 0)
    groups: dict[int, list] = {}
    for rec in records:
        groups.setdefault(rec.group_id, []).append(rec)
    assert all(len({r.seed for r in g}) == 1 for g in groups.values())


def test_a_wasted_first_move_shares_its_anchor_with_the_next_turn(text_policy):
    """window:0: a move into a wall leaves the board as it was, so turn 1's prompt equals turn 0's
    (whose observation text also holds the instructions) and the turn-level credit compares them."""
    from learner.advantages import assign_step_advantages
    from envs.sokoban.env import ACTIONS

    def reply_fn(obs, info, env):
        task = env.unwrapped
        wasted = [a for a in range(4) if task._blocked(a) is not None]
        return f"<answer>{ACTIONS[(wasted or [0])[0]]}</answer>" if info["turn"] == 0 else "<answer>Up</answer>"

    runner = Runner(text_policy, "freshper/Sokoban-v0", group_size=2, context="window:0",
                    env_kwargs={"preset": "simple", "feedback": False, "max_turns": 3})
    records, _ = runner.collect([0], policy_version=0, reply_fn=reply_fn)
    rec = records[0]
    assert rec.turns[0].observation != rec.turns[1].observation  # the first holds the instructions
    first, second = (s.token_ids[: int(np.flatnonzero(s.loss_mask)[0])] for s in rec.samples[:2])
    assert np.array_equal(first, second)
    assign_step_advantages(records, gamma=0.9)
    # four visits to the start board, two return-to-go values: each gets a nonzero step advantage
    assert all(abs(r.samples[0].advantage - r.advantage) > 0.5 for r in records)


def test_sampling_ignores_checkpoint_generation_defaults(text_policy):
    """A checkpoint's top_k/repetition penalty must not change what the runner samples from."""
    text_policy.model.generation_config.top_k = 1
    text_policy.model.generation_config.repetition_penalty = 5.0
    try:
        torch.manual_seed(0)
        prompt = text_policy.chat.first_message("hello")
        gens = text_policy.generate([prompt] * 16, max_new_tokens=4)
        assert len({tuple(g.token_ids) for g in gens}) > 1  # top_k=1 would make them all equal
    finally:
        text_policy.model.generation_config.top_k = 0
        text_policy.model.generation_config.repetition_penalty = 1.0


def test_model_player_proposes_a_reply_each_turn(cache, monkeypatch, text_policy):
    from agents.interactive import ModelPlayer
    import envs

    monkeypatch.setenv("FRESHPER_CACHE", str(cache))
    player = ModelPlayer(None, TEXT, max_new_tokens=6)
    env = envs.make(TEXT)
    obs, info = env.reset(seed=0)
    player.reset(obs, info)
    for _ in range(2):
        reply = player.act(obs)
        assert isinstance(reply, str)
        obs, *_ = env.step(reply)


def test_model_player_prompts_a_board_task_with_the_board_alone(cache, monkeypatch):
    """A human playing with feedback on and the model seeing what train.py trained it on."""
    from agents.interactive import ModelPlayer
    import envs

    monkeypatch.setenv("FRESHPER_CACHE", str(cache))
    env_id = "freshper/FrozenLake-v0"
    player = ModelPlayer(None, env_id, max_new_tokens=6)
    seen: list[str] = []
    render = player.policy.chat.first_message
    monkeypatch.setattr(player.policy.chat, "first_message", lambda text, images=(): seen.append(text) or render(text, images))
    human, board_only = envs.make(env_id), envs.make(env_id, feedback=False)  # feedback=False: train.py's default
    obs, info = human.reset(seed=4)
    expected = [board_only.reset(seed=4)[0]["text"]]
    player.reset(obs, info)
    for reply in ("<answer>Up</answer>", "not a move", "<answer>Left</answer>"):  # the player stays on S
        player.act(obs, human.unwrapped.state_text())
        obs, *_ = human.step(reply)
        expected.append(f"{info['instructions']}\n\n{board_only.step(reply)[0]['text']}")
    player.act(obs, human.unwrapped.state_text())
    assert seen == expected and "Turns left" in obs["text"]


def test_bad_context_mode_is_a_clear_error(text_policy):
    with pytest.raises(ValueError, match="window:k"):
        Runner(text_policy, TEXT, context="window:-1")
