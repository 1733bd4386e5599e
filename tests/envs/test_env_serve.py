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
from envs.serve import Limits

from conftest import Served

REPO = Path(__file__).resolve().parents[2]
LAKE = "freshper/FrozenLake-v0"



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
    with pytest.raises(RemoteEnvError, match="403 clients of this server cannot set 'no_such_kwarg'.*may set "
                                             "feedback, format_penalty, hole_reward"):
        gym.make("freshper/Remote-v0", url=lake.url, no_such_kwarg=1)
    with Served(LAKE, allow_client_kwargs=True) as open_server:  # a kwarg the task does not take: a clear 400
        with pytest.raises(RemoteEnvError, match="400 .*cannot be built with kwargs"):
            gym.make("freshper/Remote-v0", url=open_server.url, no_such_kwarg=1)


def test_batched_resets_and_steps_answer_as_one_request_each_and_as_in_process(lake) -> None:
    """``before_batch_reset`` and ``before_batch_step`` send a turn's resets and steps as one
    ``/batch`` request each; every env then reads the same answer it would have asked for alone,
    and a reset with a seed the batch did not carry asks the server itself."""
    from envs.remote import RemoteEnv

    service = lake.server.service
    remotes = [gym.make("freshper/Remote-v0", url=lake.url).unwrapped for _ in range(3)]
    locals_ = [gym.make(LAKE).unwrapped for _ in range(3)]
    counts = {"batch": 0, "run": 0}
    batch, run = service.batch, service.run
    service.batch = lambda body, **kw: counts.__setitem__("batch", counts["batch"] + 1) or batch(body, **kw)
    service.run = lambda *a, **kw: counts.__setitem__("run", counts["run"] + 1) or run(*a, **kw)
    try:
        RemoteEnv.before_batch_reset(remotes, [11, 12, 13])
        assert counts == {"batch": 1, "run": 3}
        for k, (remote, local) in enumerate(zip(remotes, locals_)):
            assert remote.reset(seed=11 + k)[0]["text"] == local.reset(seed=11 + k)[0]["text"]
        assert counts == {"batch": 1, "run": 3}  # the resets were read from the batch
        replies = ["<answer>Down</answer>", "<answer>Right</answer>", "nonsense"]
        RemoteEnv.before_batch_step(remotes, replies)
        for remote, local, reply in zip(remotes, locals_, replies):
            r, l = remote.step(reply), local.step(reply)
            assert r[0]["text"] == l[0]["text"] and r[1:] == l[1:]
        assert counts == {"batch": 2, "run": 6}
        RemoteEnv.before_batch_reset(remotes, [1, 2, 3])
        assert remotes[0].reset(seed=5)[0]["text"] == locals_[0].reset(seed=5)[0]["text"]  # not the batch's seed
        assert counts == {"batch": 3, "run": 10}
    finally:
        service.batch, service.run = batch, run
        for env in remotes + locals_:
            env.close()


# -- quick calls on the event loop -----------------------------------------------------------------
def _play(url: str, seed: int) -> list:
    """Every answer of a scripted game of three envs: batched resets and steps, single steps, calls."""
    from envs.remote import RemoteEnv

    rng = np.random.default_rng(seed)
    remotes = [gym.make("freshper/Remote-v0", url=url).unwrapped for _ in range(3)]
    out = []
    try:
        RemoteEnv.before_batch_reset(remotes, [seed, seed + 1, seed + 2])
        out += [r.reset(seed=seed + k) for k, r in enumerate(remotes)]
        for turn in range(12):
            replies = [f"<answer>{rng.choice(['Left', 'Down', 'Right', 'Up'])}</answer>" for _ in remotes]
            if turn % 2:
                RemoteEnv.before_batch_step(remotes, replies)
            for k, (remote, reply) in enumerate(zip(remotes, replies)):
                step = remote.step(reply)
                out.append(step)
                if step[2] or step[3]:
                    out.append(remote.reset(seed=100 * seed + turn * 3 + k))
            out.append([remote.render_text() for remote in remotes])
    finally:
        for remote in remotes:
            remote.close()
    return out


def test_quick_calls_are_answered_on_the_event_loop_exactly_as_in_the_pool(lake) -> None:
    """FrozenLake declares its resets, steps and calls quick: the server answers them on its
    event loop, and every answer equals the one a server answering in its pool gives."""
    assert lake.server.service.quick == {"reset", "step", "call"}
    before = lake.server.app.inline_answers
    inline = _play(lake.url, 3)
    assert lake.server.app.inline_answers - before >= 40
    with Served(LAKE, inline=False) as pooled:
        assert pooled.server.service.quick == frozenset()
        assert _play(pooled.url, 3) == inline
        assert pooled.server.app.inline_answers == 0
    assert envs.task_class("freshper/FrozenLakeVision-v0").quick_calls == frozenset()


def _health_seconds(url: str) -> float:
    t0 = time.monotonic()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    return time.monotonic() - t0


def test_a_quick_call_on_a_session_another_request_holds_waits_in_the_pool_not_on_the_loop(lake) -> None:
    """A step of a session held by another request is not waited for on the event loop: the
    server goes on answering, and the step (alone, or the middle call of a batch) is answered
    once the session is free, as in-process."""
    from envs.remote import RemoteEnv

    service = lake.server.service
    remotes = [gym.make("freshper/Remote-v0", url=lake.url).unwrapped for _ in range(3)]
    locals_ = [gym.make(LAKE).unwrapped for _ in range(3)]
    try:
        for k, (remote, local) in enumerate(zip(remotes, locals_)):
            remote.reset(seed=k)
            local.reset(seed=k)
        for batched in (False, True):
            held = service._sessions[remotes[1]._session].lock
            held.acquire()
            answers: dict[int, tuple] = {}
            replies = ["<answer>Right</answer>", "<answer>Down</answer>", "<answer>Right</answer>"]

            def play() -> None:
                if batched:
                    RemoteEnv.before_batch_step(remotes, replies)
                    for k, remote in enumerate(remotes):
                        answers[k] = remote.step(replies[k])
                else:
                    answers[1] = remotes[1].step(replies[1])

            worker = threading.Thread(target=play)
            worker.start()
            try:
                time.sleep(0.3)
                assert not answers and worker.is_alive()  # the held session's step waits...
                assert _health_seconds(lake.url) < 1.0  # ...and the server goes on answering
            finally:
                held.release()
            worker.join(10)
            assert not worker.is_alive()
            for k in ((0, 1, 2) if batched else (1,)):
                want = locals_[k].step(replies[k])
                assert answers[k][0]["text"] == want[0]["text"] and answers[k][1:] == want[1:]
    finally:
        for env in remotes + locals_:
            env.close()


def test_a_quick_call_past_the_budget_sends_every_later_call_to_the_pool(caplog) -> None:
    """A task that declares its steps quick but takes 0.3 s over one: the server notices, warns
    and answers its calls in the pool from then on, so a second slow step no longer holds
    ``/health`` up."""
    from envs.frozenlake import FrozenLakeEnv

    class SlowLake(FrozenLakeEnv):
        def step(self, action):
            if "slow" in action:
                time.sleep(0.3)
            return super().step(action)

    envs.register("tests/SlowLake-v0", SlowLake, modality="text", override=True)
    try:
        with Served("tests/SlowLake-v0") as served:
            assert served.server.service.quick == {"reset", "step", "call"}
            env = gym.make("freshper/Remote-v0", url=served.url)
            env.reset(seed=0)
            with caplog.at_level("WARNING", logger="envs.serve"):
                env.step("slow <answer>Right</answer>")
            assert served.server.service.quick == frozenset()
            assert any("from now on" in r.getMessage() for r in caplog.records)
            worker = threading.Thread(target=env.step, args=("slow <answer>Down</answer>",))
            worker.start()
            time.sleep(0.05)
            assert _health_seconds(served.url) < 0.2
            worker.join(10)
            env.close()
    finally:
        envs.unregister("tests/SlowLake-v0")


# -- what a client controls ------------------------------------------------------------------------
COUNTDOWN = "freshper/Countdown-v0"


def test_a_client_cannot_make_the_server_compute_an_answer_in_its_own_process() -> None:
    """The repro: a client opening Countdown with scoring="inline" and answering 9**9**9 froze
    the server (the answer computed in its process, holding the GIL; /health silent). Now the
    kwarg is refused, on every server, and an answer is scored in the worker process, within its
    time limit, while /health and other clients go on being answered."""
    pytest.importorskip("reasoning_gym")
    with Served(COUNTDOWN, kwargs={"score_timeout": 2.0}) as served:
        resp = httpx.post(served.url + "/sessions", json={"kwargs": {"scoring": "inline"}}, timeout=10)
        assert resp.status_code == 403 and "scoring of freshper/Countdown-v0 can be set only by the server" \
            in resp.json()["error"], resp.text
        for kwargs in ({"score_timeout": 1e9}, {"score_memory_mb": 1 << 20}, {"max_numbers": 500}):
            assert httpx.post(served.url + "/sessions", json={"kwargs": kwargs}, timeout=10).status_code == 403
        assert served.server.service.open_sessions == 0
        assert httpx.get(served.url + "/info").json()["kwargs"]["scoring"] == "worker"

        env = gym.make("freshper/Remote-v0", url=served.url, client_timeout=60)
        other = gym.make("freshper/Remote-v0", url=served.url)
        env.reset(seed=0)
        other.reset(seed=1)
        result: dict = {}
        stepping = threading.Thread(target=lambda: result.update(out=env.step("<answer>9**9**9</answer>")))
        t0 = time.monotonic()
        stepping.start()
        answered = []
        while stepping.is_alive() and time.monotonic() - t0 < 30:
            h0 = time.monotonic()
            assert httpx.get(served.url + "/health", timeout=2).json()["status"] == "ok"
            answered.append(time.monotonic() - h0)
            assert other.unwrapped.render_text()  # another session is served meanwhile
            time.sleep(0.1)
        stepping.join(timeout=30)
        _, reward, _, _, info = result["out"]
        assert reward == 0.0 and "timed out after 2 s" in info["score_error"], info
        assert answered and max(answered) < 1.0, answered
        env.close()
        other.close()
    with Served(COUNTDOWN, allow_client_kwargs=True) as served:  # not even a permissive server takes it
        resp = httpx.post(served.url + "/sessions", json={"kwargs": {"scoring": "inline"}}, timeout=10)
        assert resp.status_code == 403 and "only by the server" in resp.json()["error"]


def test_client_kwargs_are_the_tasks_allow_list_within_its_bounds() -> None:
    """A client sets only what the task declares, within bounds: a 10000x10000 FrozenLake (44 s
    and 1.5 GB per session) is a 400, a level file or a retrieval url a 403."""
    def open_status(url: str, kwargs: dict) -> tuple[int, str]:
        resp = httpx.post(url + "/sessions", content=json.dumps({"kwargs": kwargs}), timeout=30)  # NaN as JSON's NaN
        return resp.status_code, resp.json().get("error", "")

    with Served(LAKE) as served:
        t0 = time.monotonic()
        for kwargs in ({"max_turns": 10**6}, {"size": 6.5}, {"size": 10000}, {"size": 1}, {"size": True},
                       {"p": float("nan")}, {"map_name": "x" * 10_000}, {"feedback": "no"}):
            status, error = open_status(served.url, kwargs)
            assert status == 400 and len(error) < 400, (kwargs, status, error)
        assert time.monotonic() - t0 < 5 and served.server.service.open_sessions == 0
        assert "size must lie in [2, 12], got 10000" in open_status(served.url, {"size": 10000})[1]
        assert open_status(served.url, {"desc": ["SFFG"] * 4})[0] == 403
        info = httpx.get(served.url + "/info").json()
        assert info["client_kwargs"] == "declared" and info["allowed_kwargs"]["size"]["high"] == 12
    with Served("freshper/Sokoban-v0") as served:
        assert open_status(served.url, {"levels_file": "/etc/passwd"})[0] == 403
        assert open_status(served.url, {"search_budget": 10**9})[0] == 403
        assert open_status(served.url, {"preset": "hard"})[0] == 200
    with Served(LAKE, allow_client_kwargs=True) as served:  # permissive: other kwargs pass, bounds still hold
        assert open_status(served.url, {"desc": ["SFFF", "FHFH", "FFFH", "HFFG"]})[0] == 200
        assert open_status(served.url, {"size": 10000})[0] == 400
    with Served(LAKE, lock_kwargs=True) as served:
        status, error = open_status(served.url, {"size": 6})
        assert status == 403 and "--lock-kwargs" in error
        assert httpx.get(served.url + "/info").json()["client_kwargs"] == "none"
    from envs.serve import main

    with pytest.raises(SystemExit):
        main([LAKE, "--allow-client-kwargs", "--lock-kwargs"])


def test_malformed_bodies_are_4xx_and_nothing_is_echoed_at_length(lake) -> None:
    sid = httpx.post(lake.url + "/sessions", json={}).json()["session"]
    httpx.post(lake.url + f"/sessions/{sid}/reset", json={"seed": 0})
    for path, body in ((f"/sessions/{sid}/step", b'{"action": ' + b"9" * 5000 + b"}"),
                       (f"/sessions/{sid}/reset", b'{"seed": ' + b"9" * 5000 + b"}"),
                       (f"/sessions/{sid}/reset", b'{"seed": ' + b"9" * 4000 + b"}"),
                       ("/sessions", b'{"kwargs": {"size": ' + b"9" * 4000 + b"}}"),
                       (f"/sessions/{sid}/call", json.dumps({"method": "format_reply", "args": ["x" * (1 << 20)]}).encode()),
                       (f"/sessions/{sid}/call", json.dumps({"method": "format_reply", "args": [1, "x" * (1 << 20)]}).encode()),
                       ("/sessions", json.dumps({"kwargs": {"x" * (1 << 20): 1}}).encode())):
        resp = httpx.post(lake.url + path, content=body, headers={"Content-Type": "application/json"})
        assert 400 <= resp.status_code < 500 and len(resp.content) < 1000, (path, resp.status_code, resp.text[:200])
    assert httpx.get(lake.url + "/health").json()["status"] == "ok"
    httpx.delete(lake.url + f"/sessions/{sid}")


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
                             "--kw", "size=5", "--allow-client-kwargs"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"serving {LAKE}" in line and f"127.0.0.1:{port}" in line, line + proc.stderr.read()
        info = httpx.get(f"http://127.0.0.1:{port}/info").json()
        assert info["task"] == LAKE and info["kwargs"] == {"size": 5} and info["limits"]["max_sessions"] == 3
        assert info["client_kwargs"] == "any"
        env = gym.make("freshper/Remote-v0", url=f"http://127.0.0.1:{port}")
        assert env.reset(seed=0)[0]["text"] == gym.make(LAKE, size=5).reset(seed=0)[0]["text"]
        env.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
