"""verifiers environments as freshper tasks (envs/adapters/verifiers.py), against the real
verifiers package: an environment defined here (a guessing game: multi-turn through its
``env_response``, scored by a rubric), nothing downloaded."""

from __future__ import annotations

import asyncio
import sys
import time

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs

vf = pytest.importorskip("verifiers.legacy", reason="the verifiers extra is not installed (pip install -e '.[verifiers]')")
from datasets import Dataset  # noqa: E402  (verifiers depends on datasets)
from verifiers.legacy.types import Response, ResponseMessage  # noqa: E402

from envs.adapters.verifiers import import_verifiers, load_verifiers_env, register_verifiers_env  # noqa: E402

SYSTEM = "Guess the secret number from 1 to 9. Answer inside <answer>...</answer>."
FACTORY = "test_adapters_verifiers:build_guess_env"


class GuessEnv(vf.MultiTurnEnv):
    """Each reply is a guess; the environment says higher/lower until it is right."""

    async def setup_state(self, state):
        state["guesses"] = []
        return state

    async def env_response(self, messages, state, **kwargs):
        guess = self.parser.parse_answer(messages)
        if guess == "crash":
            raise KeyError("a bug in the environment")
        if guess == "infra":
            raise vf.Error("the sandbox is gone")
        if guess == "slow":
            await asyncio.sleep(5)
        if guess is None or not guess.strip().isdigit():
            return [vf.UserMessage(content="Not a number; answer one digit in <answer>...</answer>.")]
        state["guesses"].append(int(guess))
        target = int(state["answer"])
        if int(guess) == target:
            state["final_env_response"] = [vf.UserMessage(content=f"Correct, it was {target}!")]
            return state["final_env_response"]
        hint = "higher" if int(guess) < target else "lower"
        return [vf.UserMessage(content=f"{guess} is wrong: go {hint}.")]


def found(state, answer, **kwargs) -> float:
    return 1.0 if str(answer) in [str(g) for g in state["guesses"]] else 0.0


def fewer_guesses(state, answer, **kwargs) -> float:
    return 1.0 / len(state["guesses"]) if found(state, answer) else 0.0


def build_guess_env(max_turns: int = 4, n: int = 6, rubric=None, **kwargs):
    parser = vf.XMLParser(["answer"])
    rubric = rubric or vf.Rubric(funcs=[found, fewer_guesses, parser.get_format_reward_func()],
                                 weights=[1.0, 0.5, 0.0], parser=parser)
    rows = [{"question": f"Game {i}: the number is from 1 to 9.", "answer": str(1 + (3 * i + 2) % 9)}
            for i in range(n)]
    return GuessEnv(dataset=Dataset.from_list(rows), system_prompt=SYSTEM, parser=parser, rubric=rubric,
                    max_turns=max_turns, **kwargs)


class ScriptedClient(vf.Client):
    """A verifiers model client replying from a script: verifiers' own rollout for comparison."""

    def __init__(self, replies):
        super().__init__(None)
        self.replies = list(replies)

    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        return self.replies.pop(0)

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, response):
        return Response(id="scripted", created=int(time.time()), model="scripted",
                        message=ResponseMessage(role="assistant", content=response, finish_reason="stop",
                                                is_truncated=False))

    async def close(self):
        return None


def verifiers_rollout(vf_env, index: int, replies: list[str]) -> dict:
    """verifiers' own rollout of dataset row ``index`` with ``replies``, scored by its rubric."""
    row = dict(vf_env.get_dataset()[index])
    return asyncio.run(vf_env.run_rollout(row, ScriptedClient(replies), "scripted", {}))


def env_messages(output: dict) -> list[str]:
    """What the environment said after each reply in a verifiers rollout output."""
    said, current = [], None
    for m in output["completion"]:
        if m.role == "assistant":
            if current is not None:
                said.append(current)
            current = ""
        else:
            current = m.content if not current else f"{current}\n\n{m.content}"
    said.append(current or "")
    return said


def play(env, index: int, replies: list[str]):
    obs, info = env.reset(seed=0, options={"index": index})
    observations, rewards, last = [], [], None
    for reply in replies:
        obs, reward, terminated, truncated, info = env.step(reply)
        observations.append(obs["text"])
        rewards.append(reward)
        last = (terminated, truncated, info)
        if terminated or truncated:
            break
    return observations, rewards, last


@pytest.fixture(scope="module")
def guess_env():
    return build_guess_env()


def test_gymnasiums_checker_passes_and_reset_shows_the_prompt(guess_env) -> None:
    env = gym.make("freshper/Verifiers-v0", env=guess_env, render_mode="ansi")
    check_env(env.unwrapped)
    obs, info = env.reset(seed=3)
    row = guess_env.get_dataset()[info["index"]]
    assert info["instructions"] == SYSTEM
    assert obs["text"] == f"{SYSTEM}\n\n{row['question']}"
    assert env.render() == row["question"]
    again, info2 = env.reset(seed=3)
    assert again == obs and info2["index"] == info["index"]
    assert {env.reset(seed=s)[1]["index"] for s in range(60)} == set(range(len(guess_env.get_dataset())))
    env.close()


@pytest.mark.parametrize("index, replies", [
    (0, ["<answer>5</answer>", "<answer>2</answer>", "<answer>3</answer>"]),  # found on the third guess
    (1, ["no tag at all", "<answer>9</answer>", "<answer>1</answer>", "<answer>4</answer>"]),  # max_turns
    (2, ["<answer>9</answer>"]),  # found at once
])
def test_an_episode_gives_what_verifiers_own_rollout_gives_for_the_same_replies(guess_env, index, replies) -> None:
    env = gym.make("freshper/Verifiers-v0", env=guess_env)
    observations, rewards, (terminated, truncated, info) = play(env, index, replies)
    env.close()
    output = verifiers_rollout(guess_env, index, replies)

    assert observations == env_messages(output)[:len(observations)]
    assert len(observations) == len(replies)  # verifiers asked for every reply, and no more
    assert rewards[:-1] == [0.0] * (len(rewards) - 1)
    assert rewards[-1] == pytest.approx(output["reward"])
    assert info["metrics"] == pytest.approx(output["metrics"])
    assert set(info["metrics"]) == {"found", "fewer_guesses", "format_reward_func", "num_turns"}
    assert info["stop_condition"] == output["stop_condition"]
    found_it = output["metrics"]["found"] == 1.0
    assert info["success"] == (output["reward"] >= guess_env.pass_threshold) and info["success"] == found_it
    assert (terminated, truncated) == (True, False)  # verifiers scored the rollout as complete
    if found_it:
        assert observations[-1].startswith("Correct")  # the final env response is the last observation
    assert "failed" not in info


def test_a_single_turn_environment_ends_after_one_reply() -> None:
    parser = vf.XMLParser(["answer"])

    def exact(completion, answer, **kwargs) -> float:
        return 1.0 if parser.parse_answer(completion) == answer else 0.0

    rows = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "What is 4 * 2?", "answer": "8"}]
    single = vf.SingleTurnEnv(dataset=Dataset.from_list(rows), parser=parser, rubric=vf.Rubric(funcs=[exact]))
    env = gym.make("freshper/Verifiers-v0", env=single)
    for reply in ("<answer>8</answer>", "<answer>9</answer>"):
        obs, info = env.reset(seed=0, options={"index": 1})
        assert obs["text"] == "What is 4 * 2?" and info["instructions"] == ""
        obs, reward, terminated, truncated, info = env.step(reply)
        output = verifiers_rollout(single, 1, [reply])
        assert (obs["text"], terminated, truncated) == ("", True, False)
        assert reward == output["reward"] == (1.0 if reply == "<answer>8</answer>" else 0.0)
        assert info["success"] == (reward == 1.0) and info["metrics"] == output["metrics"]
    env.close()


def test_the_env_response_hook_sees_the_replies_and_state_persists_across_turns(guess_env) -> None:
    env = gym.make("freshper/Verifiers-v0", env=guess_env)
    env.reset(seed=0, options={"index": 0})  # the number is 3
    assert env.step("<answer>1</answer>")[0]["text"] == "1 is wrong: go higher."
    assert env.step("<answer>7</answer>")[0]["text"] == "7 is wrong: go lower."
    obs, reward, terminated, _, info = env.step("<answer>3</answer>")
    assert obs["text"] == "Correct, it was 3!" and terminated
    assert reward == pytest.approx(1.0 + 0.5 / 3) and info["metrics"]["num_turns"] == 3
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("<answer>3</answer>")
    env.close()


def test_an_episode_abandoned_mid_way_is_cancelled_and_the_next_reset_starts_afresh(guess_env) -> None:
    env = gym.make("freshper/Verifiers-v0", env=guess_env)
    env.reset(seed=0, options={"index": 0})
    first = env.unwrapped._rollout
    env.step("<answer>1</answer>")
    env.reset(seed=0, options={"index": 0})
    assert first.future.done()
    _, _, (terminated, _, info) = play(env, 0, ["<answer>3</answer>"])
    assert terminated and info["metrics"]["num_turns"] == 1  # the new rollout, not the old one
    env.close()
    assert env.unwrapped._rollout is None


def test_freshpers_turn_cap_truncates_and_cancels_the_rollout(guess_env) -> None:
    env = gym.make("freshper/Verifiers-v0", env=guess_env, max_turns=2)
    env.reset(seed=0, options={"index": 0})
    rollout = env.unwrapped._rollout
    assert env.step("<answer>1</answer>")[2:4] == (False, False)
    obs, reward, terminated, truncated, info = env.step("<answer>2</answer>")
    assert (reward, terminated, truncated) == (0.0, False, True) and "metrics" not in info
    assert rollout.future.done()
    env.close()


def test_an_environment_by_factory_and_by_installed_id(tmp_path, monkeypatch) -> None:
    env = envs.make("freshper/Verifiers-v0", env=FACTORY, env_args={"max_turns": 2, "n": 3})
    assert env.unwrapped.max_turns == 2 and len(env.unwrapped.dataset) == 3
    _, _, (terminated, _, info) = play(env, 0, ["<answer>1</answer>", "<answer>2</answer>"])
    assert terminated and info["stop_condition"] == "max_turns_reached"
    # the same name and arguments: the environment is loaded once and shared
    assert envs.make("freshper/Verifiers-v0", env=FACTORY, env_args={"max_turns": 2, "n": 3}).unwrapped.vf_env \
        is env.unwrapped.vf_env

    # an installed verifiers environment: a module with load_environment, found by vf.load_environment
    (tmp_path / "freshper_guess_game.py").write_text(
        "from test_adapters_verifiers import build_guess_env\n\n"
        "def load_environment(n=5):\n    return build_guess_env(n=n)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    by_id = envs.make("freshper/Verifiers-v0", env="freshper-guess-game", env_args={"n": 2})
    assert len(by_id.unwrapped.dataset) == 2
    assert by_id.reset(seed=0)[1]["instructions"] == SYSTEM
    by_id.close()
    env.close()

    spec = register_verifiers_env("verifiers/GuessGame-v0", FACTORY, env_args={"n": 2}, override=True)
    try:
        assert spec.kwargs["env"] == FACTORY and spec.requires == ("verifiers",)
        own = gym.make("verifiers/GuessGame-v0")
        assert len(own.unwrapped.dataset) == 2
        own.close()
    finally:  # the registry is the process's: leave it as the other tests find it
        envs.unregister("verifiers/GuessGame-v0")
    assert "verifiers/GuessGame-v0" not in gym.registry


def test_bad_environments_and_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="Could not import 'no-such-verifiers-env'"):
        envs.make("freshper/Verifiers-v0", env="no-such-verifiers-env")
    with pytest.raises(ImportError, match="factory 'test_adapters_verifiers:nope' could not be loaded"):
        envs.make("freshper/Verifiers-v0", env="test_adapters_verifiers:nope")
    with pytest.raises(TypeError, match="returned a str, not a verifiers Environment"):
        envs.make("freshper/Verifiers-v0", env=lambda: "not an env")
    with pytest.raises(ValueError, match="cannot be applied to an Environment object"):
        envs.make("freshper/Verifiers-v0", env=build_guess_env(), env_args={"n": 2})

    def group_reward(states, **kwargs) -> list[float]:
        return [1.0] * len(states)

    grouped = build_guess_env(rubric=vf.Rubric(funcs=[group_reward]))
    with pytest.raises(ValueError, match="group reward functions"):
        envs.make("freshper/Verifiers-v0", env=grouped)


def test_faults_of_the_environment(guess_env) -> None:
    env = gym.make("freshper/Verifiers-v0", env=guess_env)
    env.reset(seed=0, options={"index": 0})
    with pytest.raises(RuntimeError, match="raised during its rollout: KeyError"):  # a bug in env code surfaces
        env.step("<answer>crash</answer>")

    env.reset(seed=0, options={"index": 0})  # an error verifiers records: a failed episode, not learned from
    obs, reward, terminated, truncated, info = env.step("<answer>infra</answer>")
    assert info["failed"] and "the sandbox is gone" in info["error"] and info["stop_condition"] == "has_error"

    slow = gym.make("freshper/Verifiers-v0", env=guess_env, timeout=0.3)
    slow.reset(seed=0, options={"index": 0})
    t0 = time.perf_counter()
    obs, reward, terminated, truncated, info = slow.step("<answer>slow</answer>")
    assert time.perf_counter() - t0 < 3
    assert info["failed"] and "did not respond within 0.3 s" in info["error"] and truncated
    assert slow.reset(seed=0, options={"index": 0})[1]["index"] == 0  # the next episode plays
    slow.close()
    env.close()


def test_random_replies_take_the_environments_format(guess_env) -> None:
    env = envs.make("freshper/Verifiers-v0", env=guess_env)
    env.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(5):
        reply = env.unwrapped.sample_reply(rng)
        assert guess_env.parser.parse_answer([{"role": "assistant", "content": reply}]) is not None
    env.close()


def test_a_missing_or_too_new_verifiers_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers", None)  # not installed
    spec = envs.task_spec("freshper/Verifiers-v0")
    assert not spec.available and "pip install -e '.[verifiers]'" in spec.install_hint
    with pytest.raises(ImportError, match=r"needs the Python package\(s\) verifiers.*\.\[verifiers\]"):
        envs.make("freshper/Verifiers-v0", env="anything")
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "verifiers.legacy", None)  # verifiers 0.4: the classic API is gone
    with pytest.raises(ImportError, match=r"classic environment API.*0\.4 removed.*verifiers>=0\.3\.1,<0\.4"):
        import_verifiers()


def test_the_runner_plays_the_adapted_task_and_records_what_verifiers_scores() -> None:
    import torch

    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from agents.policies.tiny import build_tiny_model

    torch.set_num_threads(1)
    policy = Policy.from_pretrained(build_tiny_model("text"))
    runner = Runner(policy, "freshper/Verifiers-v0", env_kwargs={"env": FACTORY, "env_args": {"max_turns": 3}},
                    group_size=2, max_new_tokens=6, seed=0, context="window:1")
    records, stats = runner.collect([4, 5], policy_version=0, rng_seed=1)
    runner.close()
    assert len(records) == 4 and stats
    assert any(len(rec.turns) > 1 for rec in records)  # multi-turn: the environment answered replies
    vf_env = load_verifiers_env(FACTORY, {"max_turns": 3})  # the environment the runner's tasks share
    probe = envs.make("freshper/Verifiers-v0", env=FACTORY, env_args={"max_turns": 3})
    for rec in records:
        assert 1 <= len(rec.turns) <= 3 and rec.samples
        index = probe.reset(seed=rec.seed)[1]["index"]
        replies = [t.reply for t in rec.turns]
        output = verifiers_rollout(vf_env, index, replies)
        assert rec.episode_return == pytest.approx(output["reward"])
        assert [t.observation for t in rec.turns][1:] == env_messages(output)[:len(replies) - 1]
        assert rec.info["final_observation"] == env_messages(output)[len(replies) - 1]
    probe.close()


def test_building_an_environment_leaves_the_hosts_signal_handlers_as_they_were() -> None:
    """Issue 54 item 10: building a verifiers environment through the adapter installed verifiers'
    process-wide SIGTERM handler (``exit(143)``), which turned a later SIGTERM into a SystemExit
    inside whatever code ran (seen in matplotlib)."""
    import signal

    def host_term(signum, frame) -> None:
        pass

    def host_int(signum, frame) -> None:
        pass

    before = signal.signal(signal.SIGTERM, host_term), signal.signal(signal.SIGINT, host_int)
    try:
        env = envs.make("freshper/Verifiers-v0", env=FACTORY, env_args={"max_turns": 2, "n": 4})
        env.close()
        assert signal.getsignal(signal.SIGTERM) is host_term and signal.getsignal(signal.SIGINT) is host_int
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGINT, before[1])
