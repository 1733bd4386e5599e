"""OpenEnv environments as freshper tasks (envs/adapters/openenv.py), against a real OpenEnv
server on loopback: openenv-core's own ``create_fastapi_app`` serving an environment defined
here (say the word: the server keeps attempts across steps, so it takes a real session)."""

from __future__ import annotations

import random
import socket
import sys
import threading
import time

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import envs

server_api = pytest.importorskip("openenv.core.env_server",
                                 reason="the openenv extra is not installed (pip install -e '.[openenv]')")
uvicorn = pytest.importorskip("uvicorn")

WORDS = ["apple", "river", "stone", "cloud", "maple"]


class SayAction(server_api.Action):
    message: str


class SayObservation(server_api.Observation):
    prompt: str
    attempts: int = 0


class SayTheWord(server_api.Environment):
    """Say the word the server names; three attempts, reward 1 for the right word."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.target, self.attempts = "", 0

    def reset(self, seed=None, episode_id=None, **kwargs) -> SayObservation:
        self.target, self.attempts = random.Random(seed).choice(WORDS), 0
        return SayObservation(prompt=f"Say the word {self.target}.", attempts=0, done=False, reward=0.0)

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> SayObservation:
        self.attempts += 1
        if action.message.strip().lower() == self.target:
            return SayObservation(prompt="Well said.", attempts=self.attempts, done=True, reward=1.0)
        return SayObservation(prompt=f"No. Say {self.target} (attempt {self.attempts} of 3).",
                              attempts=self.attempts, done=self.attempts >= 3, reward=0.0)

    @property
    def state(self) -> server_api.State:
        return server_api.State(step_count=self.attempts)


class Server:
    """openenv-core's app for :class:`SayTheWord`, served by uvicorn on a loopback port."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        app = server_api.create_fastapi_app(SayTheWord, SayAction, SayObservation, max_concurrent_envs=8)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", ws="websockets-sansio",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the OpenEnv server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    served = Server()
    yield served
    served.stop()


def test_gymnasiums_checker_passes_and_seeded_resets_repeat(server) -> None:
    env = gym.make("freshper/OpenEnv-v0", url=server.url, observation_field="prompt", render_mode="ansi",
                   instructions="Reply with the word only.")
    check_env(env.unwrapped)
    obs, info = env.reset(seed=7)
    assert obs["text"].startswith("Reply with the word only.\n\nSay the word ")
    assert info["instructions"] == "Reply with the word only." and info["observation"]["attempts"] == 0
    assert env.reset(seed=7)[0] == obs
    assert len({env.reset(seed=s)[0]["text"] for s in range(30)}) == len(WORDS)  # seeds reach the server
    env.close()


def test_a_multi_turn_episode_keeps_the_servers_state_across_steps(server) -> None:
    env = gym.make("freshper/OpenEnv-v0", url=server.url)
    obs, info = env.reset(seed=1)
    target = info["observation"]["prompt"].removeprefix("Say the word ").rstrip(".")
    # every field of the observation, by default: the server's attempts counter goes on
    assert obs["text"] == f"prompt: Say the word {target}.\nattempts: 0"
    obs, reward, terminated, truncated, info = env.step("banana")
    assert obs["text"] == f"prompt: No. Say {target} (attempt 1 of 3).\nattempts: 1"
    assert (reward, terminated, truncated, info["success"]) == (0.0, False, False, False)
    obs, reward, terminated, truncated, info = env.step(12345)  # not a string: sent as ""
    assert info["observation"]["attempts"] == 2
    obs, reward, terminated, truncated, info = env.step(f"  {target.upper()} ")
    assert (obs["text"], reward, terminated, truncated, info["success"]) == \
        ("prompt: Well said.\nattempts: 3", 1.0, True, False, True)
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step(target)
    # the server ends a failed episode; a new episode on the same session starts afresh
    env.reset(seed=2)
    for _ in range(3):
        obs, reward, terminated, truncated, info = env.step("wrong")
    assert terminated and reward == 0.0 and not info["success"] and info["observation"]["attempts"] == 3
    env.close()


def test_sessions_are_independent_and_the_turn_cap_truncates(server) -> None:
    a = gym.make("freshper/OpenEnv-v0", url=server.url, observation_field="prompt")
    b = gym.make("freshper/OpenEnv-v0", url=server.url, observation_field="prompt", max_turns=2)
    a.reset(seed=0)
    b.reset(seed=0)
    a.step("x")
    assert b.step("y")[4]["observation"]["attempts"] == 1  # b's session did not see a's step
    assert a.step("x")[4]["observation"]["attempts"] == 2
    _, _, terminated, truncated, _ = b.step("y")
    assert (terminated, truncated) == (False, True)
    a.close()
    b.close()


def test_the_runner_plays_an_openenv_task(server) -> None:
    import torch

    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from agents.policies.tiny import build_tiny_model

    torch.set_num_threads(1)
    policy = Policy.from_pretrained(build_tiny_model("text"))
    runner = Runner(policy, "freshper/OpenEnv-v0", env_kwargs={"url": server.url, "observation_field": "prompt"},
                    group_size=2, max_new_tokens=4, seed=0, context="full")
    records, stats = runner.collect([3], policy_version=0, rng_seed=2)
    runner.close()
    assert len(records) == 2 and stats["turns"] == sum(len(r.turns) for r in records)
    for rec in records:
        target = rec.turns[0].observation.removeprefix("Say the word ").rstrip(".")
        assert target in WORDS and len(rec.turns) == 3  # the tiny model never says the word
        assert [t.observation for t in rec.turns[1:]] == [f"No. Say {target} (attempt {k} of 3)." for k in (1, 2)]
        assert rec.info["final_observation"] == f"No. Say {target} (attempt 3 of 3)."
        assert rec.episode_return == 0.0 and not rec.success and len(rec.samples) == 1


def test_server_faults_and_misconfigurations_are_named(server) -> None:
    wrong_field = gym.make("freshper/OpenEnv-v0", url=server.url, action_field="text")
    wrong_field.reset(seed=0)
    with pytest.raises(RuntimeError, match="rejected the step .*action field 'text'"):
        wrong_field.step("apple")
    wrong_field.close()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    nowhere = gym.make("freshper/OpenEnv-v0", url=f"http://127.0.0.1:{free_port}", connect_timeout=2)
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{free_port}"):
        nowhere.reset(seed=0)

    gone = Server()
    env = gym.make("freshper/OpenEnv-v0", url=gone.url, message_timeout=5)
    env.reset(seed=0)
    gone.stop()
    obs, reward, terminated, truncated, info = env.step("apple")  # mid-episode: a failed episode
    assert info["failed"] and gone.url in info["error"] and truncated and reward == 0.0
    with pytest.raises(ConnectionError):  # and the next reset says the server is down
        env.reset(seed=0)
    env.close()

    with pytest.raises(ValueError, match="may not set the reply's own field"):
        gym.make("freshper/OpenEnv-v0", url=server.url, action_extra={"message": "x"})


def test_a_missing_openenv_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "openenv", None)
    assert not envs.task_spec("freshper/OpenEnv-v0").available
    with pytest.raises(ImportError, match=r"needs the Python package\(s\) openenv.*\.\[openenv\]"):
        envs.make("freshper/OpenEnv-v0", url="http://127.0.0.1:1")
