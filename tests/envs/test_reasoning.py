"""Reasoning tasks on reasoning-gym's generators: problems, the generator's own score as reward,
multi-attempt feedback, random well-formed answers, scoring that cannot hang, and the listing
when reasoning-gym is not installed."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import envs
from envs.play import main as play_main
from envs.play import play

rg = pytest.importorskip("reasoning_gym")
REPO = Path(__file__).resolve().parents[2]


def test_seeded_reset_picks_the_generators_problem_and_its_score_is_the_reward() -> None:
    env = gym.make("freshper/ReasoningGym-v0", task="chain_sum", min_terms=2, max_terms=3, min_digits=1,
                   max_digits=2, size=1000, dataset_seed=7)
    obs, info = env.reset(seed=3)
    inner = env.unwrapped
    reference = rg.create_dataset("chain_sum", min_terms=2, max_terms=3, min_digits=1, max_digits=2, size=1000, seed=7)
    entry = reference[inner.index]
    assert entry["question"].strip() in obs["text"] and info["instructions"] in obs["text"]
    assert env.reset(seed=3)[0] == obs  # deterministic
    assert len({gym.make("freshper/ReasoningGym-v0", task="chain_sum").reset(seed=s)[0]["text"] for s in range(8)}) > 1
    gold = entry["answer"]
    wrong = str(int(gold) + 1)
    for answer in [gold, wrong, "1" + gold, f"{gold} apples"]:
        env.reset(seed=3)
        _, reward, terminated, truncated, info = env.step(f"Adding up... <answer>{answer}</answer>")
        expected = float(reference.score_answer(answer, entry))
        assert reward == pytest.approx(expected) and info["score"] == pytest.approx(expected)
        assert (terminated, truncated, info["success"]) == (True, False, expected == 1.0)
    assert reward not in (0.0, 1.0)  # "N apples" gets the generator's partial credit


def test_a_reply_without_an_answer_is_invalid_and_costs_the_format_penalty() -> None:
    env = gym.make("freshper/Arithmetic-v0", max_turns=3)
    env.reset(seed=0)
    for reply in ["the answer is 12", "<answer>  </answer>", "<answer>" + "1" * 3000 + "</answer>"]:
        obs, reward, terminated, truncated, info = env.step(reply)
        assert not info["action_is_valid"] and reward == pytest.approx(-0.1) and not terminated
        assert "Invalid reply" in obs["text"]
    assert truncated  # max_turns counts invalid replies too


def test_max_attempts_gives_feedback_after_a_wrong_answer_and_ends_on_the_right_one() -> None:
    env = gym.make("freshper/Countdown-v0")  # three attempts
    obs, info = env.reset(seed=5)
    inner = env.unwrapped
    assert "You have 3 attempts" in info["instructions"] and "Attempts left: 3." in obs["text"]
    numbers, target = inner.entry["metadata"]["numbers"], inner.entry["metadata"]["target"]
    wrong = " + ".join(str(n) for n in numbers) if sum(numbers) != target else " * ".join(map(str, numbers))
    obs, reward, terminated, truncated, info = env.step(f"<answer>{wrong}</answer>")
    assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
    assert "is not correct; try again (2 attempts left)" in obs["text"] and "Attempts left: 2." in obs["text"]
    assert inner.outcome_text(False, False) == "not correct"
    obs, reward, terminated, truncated, info = env.step(f"<answer>{inner.entry['answer']}</answer>")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    assert inner.outcome_text(True, True) == "correct"
    env.reset(seed=5)
    for _ in range(3):
        _, reward, terminated, _, info = env.step(f"<answer>{wrong}</answer>")
    assert terminated and info["attempts"] == 3 and reward == pytest.approx(0.05)  # the generator's last score


def test_random_answers_are_well_formed_and_of_the_answers_kind() -> None:
    rng = np.random.default_rng(0)
    count = gym.make("freshper/Countdown-v0").unwrapped
    hits = 0
    for seed in range(40):
        count.reset(seed=seed)
        reply = count.sample_reply(rng)
        content = envs.extract_tag(reply)
        used = sorted(int(t) for t in content.replace("+", " ").replace("-", " ").replace("*", " ").split())
        assert used == sorted(count.entry["metadata"]["numbers"])  # an expression over the given numbers
        hits += count.step(reply)[4]["success"]
    assert 0 < hits < 40  # random expressions sometimes reach the target: a real dynamics signal
    arith = gym.make("freshper/Arithmetic-v0").unwrapped
    for seed in range(20):
        arith.reset(seed=seed)
        content = envs.extract_tag(arith.sample_reply(rng))
        assert content.lstrip("-").isdigit() and len(content.lstrip("-")) == len(arith.entry["answer"].lstrip("-"))
    words = gym.make("freshper/ReasoningGym-v0", task="spell_backward").unwrapped
    words.reset(seed=0)
    assert words.parse_action(words.sample_reply(rng))[1] is None


def test_unknown_generators_settings_and_a_seed_kwarg_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="no generator 'chain_sums'. Did you mean 'chain_sum'"):
        gym.make("freshper/ReasoningGym-v0", task="chain_sums")
    with pytest.raises(ValueError, match=r"no setting\(s\) \['max_termz'\].*'max_terms'"):
        gym.make("freshper/ReasoningGym-v0", task="chain_sum", max_termz=3)
    with pytest.raises(ValueError, match="invalid settings for reasoning-gym generator 'chain_sum'"):
        gym.make("freshper/ReasoningGym-v0", task="chain_sum", min_terms=5, max_terms=2)
    with pytest.raises(ValueError, match="dataset_seed="):
        gym.make("freshper/ReasoningGym-v0", task="chain_sum", seed=3)


def test_an_answer_the_scorer_cannot_finish_scores_zero_within_the_timeout() -> None:
    # countdown's verifier evaluates the answer with sympy: 9**9**9 never finishes there.
    env = gym.make("freshper/ReasoningGym-v0", task="countdown", max_attempts=2, score_timeout=1.0)
    env.reset(seed=1)
    start = time.perf_counter()
    obs, reward, terminated, _, info = env.step("<answer>9**9**9</answer>")
    assert time.perf_counter() - start < 60  # worker start (imports reasoning-gym) + 1 s
    assert (reward, terminated, info["action_is_valid"]) == (0.0, False, True)
    assert info["score"] == 0.0 and info["score_error"] == "scoring timed out after 1 s"
    # The worker was replaced: the next non-plain answer is scored normally.
    _, reward, terminated, _, info = env.step("<answer>x + 1</answer>")
    assert terminated and info["score_error"] == "" and reward == pytest.approx(0.01)


def test_random_play_and_listing_cover_the_reasoning_tasks() -> None:
    out = io.StringIO()
    summary = play("freshper/Countdown-v0", seed=2, random_agent=True, auto=True, stdin=io.StringIO(""), stdout=out)
    assert summary.invalid_replies == 0 and (summary.success or summary.turns == 3)  # three attempts
    assert play_main(["freshper/Arithmetic-v0", "--random", "--seed", "1"]) == 0
    ids = {s.id for s in envs.registered_tasks()}
    assert {"freshper/ReasoningGym-v0", "freshper/Arithmetic-v0", "freshper/Countdown-v0"} <= ids


def test_without_reasoning_gym_the_tasks_are_listed_with_the_install_hint_and_import_envs_works() -> None:
    code = (
        "import sys; sys.modules['reasoning_gym'] = None\n"  # as if not installed
        "import envs, gymnasium as gym\n"
        "from envs.__main__ import main\n"
        "main(['list'])\n"
        "try:\n"
        "    gym.make('freshper/Countdown-v0')\n"
        "except ImportError as exc:\n"
        "    print('ERROR', exc)\n"
        "gym.make('freshper/FrozenLake-v0').reset(seed=0); print('other tasks fine')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("freshper/Countdown-v0 "))
    assert "[not installed: pip install -e '.[reasoning]'" in line
    assert "ERROR task 'freshper/Countdown-v0' needs the Python package(s) reasoning_gym" in result.stdout
    assert "pip install -e '.[reasoning]'" in result.stdout.split("ERROR")[1] and "other tasks fine" in result.stdout
