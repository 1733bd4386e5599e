"""Tasks as network services (``python -m envs.serve``) and the gymnasium client that plays them
(``freshper/Remote-v0``), on real servers on loopback: the same observations, rewards and
records as in-process, training through it, and the server's limits."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import httpx
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import envs
from envs.remote import RemoteEnvError
from envs.serve import Limits, make_server

REPO = Path(__file__).resolve().parents[2]
LAKE = "freshper/FrozenLake-v0"


class Served:
    """A task server on a free loopback port, serving in a thread."""

    def __init__(self, env_id: str, **kwargs) -> None:
        self.server = make_server(env_id, "127.0.0.1", 0, **kwargs)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def lake():
    with Served(LAKE) as served:
        yield served


def _same_obs(a: dict, b: dict) -> None:
    assert a["text"] == b["text"]
    assert ("image" in a) == ("image" in b)
    if "image" in a:
        assert a["image"].dtype == np.uint8 and np.array_equal(a["image"], b["image"])


@pytest.mark.parametrize("env_id,remote_id", [(LAKE, "freshper/Remote-v0"),
                                              ("freshper/SokobanVision-v0", "freshper/RemoteVision-v0")])
def test_a_served_task_plays_exactly_as_in_process(env_id, remote_id) -> None:
    replies = ["<answer>Down</answer>", "nonsense", "<answer>Right</answer>", "<answer>Up</answer>",
               "İ" * 50 + "<answer>ⅮOWN</answer>", "<answer>Left</answer>"] * 3
    with Served(env_id) as served:
        remote, local = gym.make(remote_id, url=served.url), gym.make(env_id)
        try:
            for seed in (0, 7, 123):
                ro, ri = remote.reset(seed=seed)
                lo, li = local.reset(seed=seed)
                _same_obs(ro, lo)
                assert ri == li
                for reply in replies:
                    r, l = remote.step(reply), local.step(reply)
                    _same_obs(r[0], l[0])
                    assert r[1:] == l[1:]
                    if l[2] or l[3]:
                        break
            # the task contract's methods answer as the local task's do
            assert remote.unwrapped.legal_actions() == local.unwrapped.legal_actions()
            assert remote.unwrapped.render_text() == local.unwrapped.render_text()
            rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
            assert [remote.unwrapped.sample_reply(rng_a) for _ in range(5)] == \
                   [local.unwrapped.sample_reply(rng_b) for _ in range(5)]
            if remote_id.endswith("Vision-v0"):
                assert np.array_equal(remote.unwrapped.render_image(), local.unwrapped.render_image())
        finally:
            remote.close()
            local.close()


def test_the_client_passes_gymnasiums_checker_and_wrong_modalities_are_named(lake) -> None:
    env = gym.make("freshper/Remote-v0", url=lake.url, render_mode="ansi")
    check_env(env.unwrapped, skip_render_check=False)
    env.close()
    with pytest.raises(ValueError, match="play it as freshper/Remote-v0"):
        gym.make("freshper/RemoteVision-v0", url=lake.url)
    with pytest.raises(ValueError, match="FRESHPER_ENV_URL"):
        gym.make("freshper/Remote-v0")


def test_task_kwargs_go_to_the_served_task_and_bad_ones_are_clear(lake) -> None:
    env = gym.make("freshper/Remote-v0", url=lake.url, size=6, feedback=False)
    obs, _ = env.reset(seed=1)
    local = gym.make(LAKE, size=6, feedback=False)
    assert obs["text"] == local.reset(seed=1)[0]["text"]
    env.close()
    with pytest.raises(RemoteEnvError, match="400 .*cannot be built with kwargs"):
        gym.make("freshper/Remote-v0", url=lake.url, no_such_kwarg=1)


def test_the_runner_gets_the_same_records_from_a_served_task() -> None:
    import torch

    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from agents.policies.tiny import build_tiny_model

    torch.set_num_threads(1)
    policy = Policy.from_pretrained(build_tiny_model("vision"))
    with Served("freshper/FrozenLakeVision-v0") as served:
        out = []
        for env_id, kwargs in (("freshper/FrozenLakeVision-v0", {}), ("freshper/RemoteVision-v0", {"url": served.url})):
            runner = Runner(policy, env_id, env_kwargs=kwargs, group_size=2, max_new_tokens=4, seed=3, context="window:1")
            records, _ = runner.collect([5, 6], policy_version=0, rng_seed=11)
            runner.close()
            out.append(records)
    assert served.server.service.open_sessions == 0  # runner.close() closed every session
    for a, b in zip(*out):
        assert [t.__dict__ for t in a.turns] == [t.__dict__ for t in b.turns]
        assert a.episode_return == b.episode_return and a.success == b.success and a.seed == b.seed
        assert all(np.array_equal(x, y) for x, y in zip(a.images, b.images)) and len(a.images) == len(b.images)
        for s, t in zip(a.samples, b.samples):
            assert np.array_equal(s.token_ids, t.token_ids) and np.array_equal(s.behavior_logprobs, t.behavior_logprobs)


def _comparable(rec) -> dict:
    return {"seed": rec.seed, "return": rec.episode_return, "success": rec.success,
            "turns": [(t.observation, t.reply, t.reward, t.action_is_valid) for t in rec.turns],
            "samples": [(s.token_ids.tolist(), s.loss_mask.tolist(), s.behavior_logprobs.tolist()) for s in rec.samples]}


def test_train_py_trains_against_a_served_task_with_the_same_records(tmp_path: Path) -> None:
    """A few tiny iterations of train.py on a served FrozenLake and in-process: the evaluation
    records (which depend on every update before them) and the training metrics agree."""
    import learner.run
    from learner.config import make_config
    from agents.record import load_records

    tiny = dict(tasks_per_iter=2, group_size=2, max_new_tokens=4, pretrain_steps=0, eval_every=2, eval_episodes=2,
                final_eval_episodes=2, checkpoint_every=2, progress=False, tensorboard=False, threads=1, iterations=2)
    with Served(LAKE) as served:
        learner.run.train(make_config(runs_root=str(tmp_path), run_name="local", env_id=LAKE,
                                 env_kwargs={"feedback": False}, **tiny))
        learner.run.train(make_config(runs_root=str(tmp_path), run_name="remote", env_id="freshper/Remote-v0",
                                 env_kwargs={"url": served.url, "feedback": False}, **tiny))
    phases = sorted(p.name for p in (tmp_path / "local" / "eval").iterdir())
    assert phases and phases == sorted(p.name for p in (tmp_path / "remote" / "eval").iterdir())
    for phase in phases:
        local = load_records(tmp_path / "local" / "eval" / phase)
        remote = load_records(tmp_path / "remote" / "eval" / phase)
        assert [_comparable(r) for r in local] == [_comparable(r) for r in remote], phase
        assert {r.env_id for r in remote} == {"freshper/Remote-v0"}

    def train_rows(run: str) -> list[dict]:
        rows = [json.loads(l) for l in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        keep = ("iteration", "success_rate", "mean_return", "loss", "invalid_reply_rate", "sampled_tokens")
        return [{k: r[k] for k in keep if k in r} for r in rows if r.get("kind") == "train"]

    assert train_rows("local") == train_rows("remote") and train_rows("local")


# -- limits ---------------------------------------------------------------------------------------
def test_the_session_limit_is_enforced_and_frees_on_close() -> None:
    with Served(LAKE, limits=Limits(max_sessions=2)) as served:
        a = gym.make("freshper/Remote-v0", url=served.url)
        b = gym.make("freshper/Remote-v0", url=served.url, client_retries=0)
        resp = httpx.post(served.url + "/sessions", json={})
        assert resp.status_code == 503 and "session limit reached (2 of 2" in resp.json()["error"]
        assert resp.headers["retry-after"] == "1"
        with pytest.raises(RemoteEnvError, match="503 session limit"):
            gym.make("freshper/Remote-v0", url=served.url, client_retries=0)
        b.close()
        c = gym.make("freshper/Remote-v0", url=served.url, client_retries=0)  # b's slot is free again
        assert httpx.get(served.url + "/health").json()["sessions"] == 2
        a.close()
        c.close()
        assert httpx.get(served.url + "/health").json()["sessions"] == 0


def test_oversize_messages_are_refused_and_the_server_goes_on() -> None:
    with Served(LAKE, limits=Limits(max_message_bytes=64 << 10)) as served:
        env = gym.make("freshper/Remote-v0", url=served.url, client_retries=0)
        env.reset(seed=0)
        with pytest.raises(RemoteEnvError, match="413 message of .* exceeds the server's limit of 65536"):
            env.step("x" * (100 << 10))
        obs, reward, *_ = env.step("<answer>Down</answer>")  # the session is intact
        assert isinstance(reward, float) and obs["text"]
        # raw protocol faults: bad JSON, deep nesting, wrong types, unknown session, unknown path
        sid = httpx.post(served.url + "/sessions", json={}).json()["session"]
        bad = [("/sessions/%s/step" % sid, b"{not json", 400, "not valid UTF-8 JSON"),
               ("/sessions/%s/step" % sid, b"[" * 100_000 + b"]" * 100_000, 413, "exceeds"),
               ("/sessions/%s/step" % sid, b"[" * 5000 + b"]" * 5000, 400, "nested too deeply|must be a JSON object"),
               ("/sessions/%s/step" % sid, json.dumps({"action": 5}).encode(), 400, "must be a string"),
               ("/sessions/%s/reset" % sid, json.dumps({"seed": -1}).encode(), 400, "non-negative integer"),
               ("/sessions/nope/step", json.dumps({"action": "a"}).encode(), 404, "no open session"),
               ("/nowhere", b"{}", 404, "unknown endpoint"),
               ("/batch", json.dumps({"calls": [{}] * 65}).encode(), 400, "at most 64 calls")]
        for path, body, status, message in bad:
            resp = httpx.post(served.url + path, content=body, headers={"Content-Type": "application/json"})
            assert resp.status_code == status, (path, resp.text)
            assert __import__("re").search(message, resp.json()["error"]), resp.text
        env.close()


def test_a_client_stalling_mid_request_gets_a_408() -> None:
    with Served(LAKE, limits=Limits(request_timeout=0.3)) as served:
        host, port = served.server.server_address[:2]
        with socket.create_connection((host, port)) as sock:
            sock.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            sock.settimeout(5)
            assert b" 408 " in sock.recv(4096).split(b"\r\n")[0]


def test_idle_sessions_are_reaped_and_a_reset_reopens() -> None:
    with Served(LAKE, limits=Limits(idle_timeout=0.3)) as served:
        env = gym.make("freshper/Remote-v0", url=served.url)
        env.reset(seed=4)
        first = env.unwrapped._session
        deadline = time.monotonic() + 10
        while served.server.service.open_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.server.service.open_sessions == 0 and served.server.service.reaped == 1
        # a step on the reaped session ends the episode as an infrastructure fault, not a crash
        obs, reward, terminated, truncated, info = env.step("<answer>Down</answer>")
        assert info["failed"] and "404" in info["error"] and terminated and reward == 0.0
        obs, _ = env.reset(seed=4)  # a new session, the same task
        assert env.unwrapped._session != first and obs["text"] == gym.make(LAKE).reset(seed=4)[0]["text"]
        env.close()


def test_a_server_gone_mid_episode_fails_the_episode_not_the_run() -> None:
    served = Served(LAKE).__enter__()
    env = gym.make("freshper/Remote-v0", url=served.url, client_retries=1)
    env.reset(seed=0)
    served.__exit__(None, None, None)
    *_, info = env.step("<answer>Down</answer>")
    assert info["failed"] and "cannot reach the task server" in info["error"]
    with pytest.raises(RemoteEnvError, match="cannot reach the task server"):
        env.reset(seed=0)
    env.close()


def test_the_cli_serves_until_sigterm(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "envs.serve", LAKE, "--port", str(port), "--max-sessions", "3",
                             "--kw", "size=5"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"serving {LAKE}" in line and f"127.0.0.1:{port}" in line, line + proc.stderr.read()
        info = httpx.get(f"http://127.0.0.1:{port}/info").json()
        assert info["task"] == LAKE and info["kwargs"] == {"size": 5} and info["limits"]["max_sessions"] == 3
        env = gym.make("freshper/Remote-v0", url=f"http://127.0.0.1:{port}")
        assert env.reset(seed=0)[0]["text"] == gym.make(LAKE, size=5).reset(seed=0)[0]["text"]
        env.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
