"""GEM both ways: freshper tasks through GEM's own make / make_vec / wrappers, and GEM's offline
games as freshper tasks (the contract: invalid replies keep the state, seeded resets are
deterministic whatever the interleaving, the caller's global random state is untouched)."""

from __future__ import annotations

import random

import gymnasium as gym
import numpy as np
import pytest

import envs

gem = pytest.importorskip("gem")
from envs.gem_compat import FreshperGemEnv, GemGameEnv, register_in_gem  # noqa: E402


def test_a_freshper_task_through_gems_make_and_make_vec() -> None:
    register_in_gem()
    assert register_in_gem() == []  # idempotent
    env = gem.make("freshper:FrozenLake-v0")
    assert isinstance(env, gem.core.Env)
    obs, info = env.reset(seed=4)
    direct = envs.make("freshper/FrozenLake-v0")
    assert obs == direct.reset(seed=4)[0]["text"] and info["instructions"] in obs
    reply = env.sample_random_action()
    assert env.step(reply)[1:4] == direct.step(reply)[1:4]

    vec = gem.make_vec(["freshper:FrozenLake-v0"] * 3, seed=0)  # GEM's SyncVectorEnv, same-step autoreset
    observations, _ = vec.reset(seed=10)
    assert observations == [envs.make("freshper/FrozenLake-v0").reset(seed=10 + i)[0]["text"] for i in range(3)]
    finished = 0
    for _ in range(30):
        actions = [e.sample_random_action() for e in vec.envs]
        observations, rewards, terminated, truncated, _ = vec.step(actions)
        assert len(observations) == 3 and all(isinstance(o, str) for o in observations)
        finished += int(np.sum(terminated | truncated))
    assert finished > 0  # episodes ended and were reset by GEM's vector env
    from gem.wrappers.observation_wrapper import ObservationWrapper

    wrapped = ObservationWrapper(
        gem.make("freshper:Sokoban-v0"), include_action=True, include_chat_template=False)
    first, _ = wrapped.reset(seed=0)
    second = wrapped.step("<answer>Up</answer>")[0]
    assert second.startswith(first) and "<answer>Up</answer>" in second  # GEM's history concatenation


def test_a_vision_task_through_gem_carries_its_image_in_info() -> None:
    env = FreshperGemEnv("freshper/FrozenLakeVision-v0", seed=2)
    text, info = env.reset()
    assert envs.IMAGE_PLACEHOLDER in text and info["image"].dtype == np.uint8 and info["image"].ndim == 3
    assert env.spawn().reset(seed=2)[0] == text


def _play(env: gym.Env, seed: int, moves: int = 6) -> list:
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    out = [obs["text"]]
    for _ in range(moves):
        obs, reward, term, trunc, info = env.step(env.unwrapped.sample_reply(rng))
        out.append((obs["text"], reward, term, trunc, info["action_is_valid"]))
        if term or trunc:
            break
    return out


@pytest.mark.parametrize("env_id", ["gem/Game2048Easy-v0", "gem/MinesweeperEasy-v0", "gem/MastermindEasy-v0"])
def test_gem_games_are_deterministic_under_interleaving_and_leave_global_random_alone(env_id: str) -> None:
    alone = [_play(gym.make(env_id), seed) for seed in (0, 1)]
    a, b = gym.make(env_id), gym.make(env_id)
    rng_a, rng_b = np.random.default_rng(0), np.random.default_rng(1)
    random.seed(123)
    np.random.seed(123)
    py_state, np_state = random.getstate(), np.random.get_state()
    trace_a, trace_b = [a.reset(seed=0)[0]["text"]], [b.reset(seed=1)[0]["text"]]
    for _ in range(6):  # interleaved: a, b, a, b ... (GEM itself draws from the global modules)
        for env, rng, trace in ((a, rng_a, trace_a), (b, rng_b, trace_b)):
            if len(trace) > 1 and (trace[-1][2] or trace[-1][3]):
                continue
            obs, reward, term, trunc, info = env.step(env.unwrapped.sample_reply(rng))
            trace.append((obs["text"], reward, term, trunc, info["action_is_valid"]))
    assert [trace_a, trace_b] == alone
    assert random.getstate() == py_state and all(np.array_equal(x, y) for x, y in zip(np.random.get_state(), np_state))


def test_replies_gem_cannot_parse_are_invalid_here_and_change_nothing() -> None:
    env = gym.make("gem/GuessTheNumberEasy-v0", max_turns=10)  # invalid replies use turns here, not GEM's
    obs, info = env.reset(seed=3)
    inner: GemGameEnv = env.unwrapped
    assert "Guess The Number" in info["instructions"] and inner.state_text() in obs["text"]
    secret = inner.gem_env.game_number
    for reply in ["I guess seven", "\\boxed{seven}", "<answer></answer>"]:
        turn_before = inner.gem_env.turn_count
        obs, reward, terminated, _, info = env.step(reply)
        assert not info["action_is_valid"] and reward == pytest.approx(-0.1) and not terminated
        assert inner.gem_env.turn_count == turn_before  # GEM never saw it
    fresh = envs.make("gem/GuessTheNumberEasy-v0").unwrapped
    fresh.reset(seed=0)
    assert "did not provide a valid guess" in fresh.parse_action("\\boxed{x}")[1]  # GEM's own message
    wrong = 1 if secret != 1 else 2
    obs, reward, terminated, _, info = env.step(f"<answer>{wrong}</answer>")  # freshper's tag, sent as \boxed{}
    assert info["action_is_valid"] and not terminated and "the target number is" in obs["text"]
    obs, reward, terminated, _, info = env.step(f"My guess: \\boxed{{{secret}}}")
    assert (reward, terminated, info["success"]) == (1.0, True, True)


def test_unknown_gem_ids_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="GEM has no env 'game:Nope-v0'.*game:GuessTheNumber-v0-easy"):
        gym.make("gem/Game-v0", gem_id="game:Nope-v0")
