"""Rollout workers on a real local Ray cluster (``make test-ray``; skipped without ray).

- synchronous records are byte-identical to the in-process sharded runner's, also after a
  weight change, and a short training with 2 workers equals the in-process training;
- a worker killed with SIGKILL mid-collection is replaced, its shard re-collected, and the
  records are the ones it would have produced;
- asynchronous collection stamps each record with the weights it was sampled with, collects
  ahead with the last published weights, drops (and counts) records staler than allowed, and a
  training with --async keeps the buffer's ages exact.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

import learner.run  # noqa: E402
from learner.config import make_config  # noqa: E402
from agents.policies.spec import PolicySpec  # noqa: E402
from agents.rollout.shards import ShardedCollector  # noqa: E402
from agents.rollout.workers import RayCollector, ray_init  # noqa: E402
from agents.policies.policy import Policy  # noqa: E402
from agents.rollout.runner import RolloutSettings  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402
from learner.checkpoint import list_checkpoints  # noqa: E402
from learner.report import read_metrics  # noqa: E402

LAKE = RolloutSettings("freshper/FrozenLake-v0", {"feedback": False}, "window:0", group_size=2, max_new_tokens=4,
                     max_context_tokens=1024)
TINY = dict(tasks_per_iter=2, group_size=2, max_new_tokens=4, pretrain_steps=0, eval_every=0, eval_episodes=2,
            final_eval_episodes=2, checkpoint_every=2, progress=False, tensorboard=False, threads=1,
            eval_both=False, diagnostics=False)
COLLECTOR_KEYS = ("worker_restarts", "stale_dropped", "staleness_mean", "staleness_max")


@pytest.fixture(scope="session")
def cluster():
    """One local Ray cluster for the session (~4-10 s to start): 2 CPUs, a small object store."""
    started = ray_init(num_cpus=2, object_store_memory=256 * 2**20)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def model_path() -> Path:
    torch.set_num_threads(1)  # what the workers use on <= 2 CPUs (another count rounds fp32 sums differently)
    return build_tiny_model("text")


def _fresh_policy(path: Path) -> Policy:
    return Policy.from_pretrained(path)


def _perturb(policy: Policy, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def _blobs(records) -> list[bytes]:
    return [r.to_bytes() for r in records]


def _worker_pids(collector: RayCollector) -> list[int]:
    """The process id of each of the collector's worker slots, as each worker reports it."""
    return [int(i["pid"]) for i in ray.get([w.info.remote() for w in collector._slots])]


def test_sync_records_equal_the_in_process_runner_also_after_a_weight_change(cluster, model_path) -> None:
    policy = _fresh_policy(model_path)
    collector = RayCollector(policy, model_path, LAKE, workers=2, spec=PolicySpec(), seed=0)
    reference = ShardedCollector(LAKE.runner(policy, seed=0), 2)
    try:
        assert os.getpid() not in _worker_pids(collector) and len(set(_worker_pids(collector))) == 2
        request = {"seeds": [31, 32, 33, 34, 35], "rng_seed": 17, "group_base": 10}
        for version in (0, 3):
            records, stats = collector.collect(**request, policy_version=version)
            expected, _ = reference.collect(**request, policy_version=version)
            assert len(records) == 10 and _blobs(records) == _blobs(expected)
            assert {r.policy_version for r in records} == {version}
            assert sorted({r.group_id for r in records}) == [10, 11, 12, 13, 14]
            assert stats["log"] == {"worker_restarts": 0.0, "stale_dropped": 0.0, "staleness_mean": 0.0,
                                    "staleness_max": 0.0}
            before = _blobs(records)
            _perturb(policy, seed=version + 1)  # the learner's update: the next collect must use it
        after, _ = collector.collect(**request, policy_version=4)
        assert _blobs(after) != before  # the pushed weights were used
    finally:
        collector.close()


def _rows(run: Path) -> list[dict]:
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] in ("train", "eval")]
    return [{k: v for k, v in r.items() if not ("time" in k or k.endswith("per_s") or k in COLLECTOR_KEYS)}
            for r in rows]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(list_checkpoints(run / "checkpoints")[-1] / "model" / "model.safetensors"))


def test_training_with_two_workers_equals_the_in_process_training(cluster, model_path, tmp_path) -> None:
    kw = dict(iterations=2, replay="fresh", replay_batch=4, buffer_capacity=8)
    learner.run.train(make_config(runs_root=str(tmp_path), run_name="ray", rollout_workers=2, **TINY, **kw))
    learner.run.train(make_config(runs_root=str(tmp_path), run_name="local", rollout_shards=2, **TINY, **kw))
    ray_rows = [r for r in read_metrics(tmp_path / "ray" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(ray_rows) == 2 and all(r["worker_restarts"] == 0 and r["staleness_max"] == 0 for r in ray_rows)
    assert all(math.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in ray_rows)
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
    wa, wb = _weights(tmp_path / "ray"), _weights(tmp_path / "local")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ray_workers_train_on_a_served_task_as_in_process_shards_train_on_the_task(cluster, tmp_path) -> None:
    """A task served by ``python -m envs.serve``: Ray workers (the url is a task kwarg, so it travels
    with the config; each worker opens its own sessions) train as in-process shards on the task
    itself, to the same metrics and weights, and every session is closed at the end."""
    from envs.serve import make_server

    server = make_server("freshper/FrozenLake-v0", "127.0.0.1", 0)
    opened, open_session = [], server.service.open
    server.service.open = lambda body: opened.append(body) or open_session(body)  # count the sessions
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    kw = dict(iterations=2, replay="fresh", replay_batch=4, buffer_capacity=8)
    try:
        learner.run.train(make_config(runs_root=str(tmp_path), run_name="served", env_id="freshper/Remote-v0",
                                      env_kwargs={"url": server.url, "feedback": False}, rollout_workers=2,
                                      **TINY, **kw))
        learner.run.train(make_config(runs_root=str(tmp_path), run_name="local", env_id="freshper/FrozenLake-v0",
                                      env_kwargs={"feedback": False}, rollout_shards=2, **TINY, **kw))
        assert server.service.open_sessions == 0 and len(opened) >= 2  # each worker played through it
    finally:
        server.shutdown()
        server.server_close()

    def train_rows(run: str) -> list[dict]:
        return [r for r in _rows(tmp_path / run) if r["kind"] == "train"]

    served = train_rows("served")
    assert len(served) == 2 and all(r["worker_restarts"] == 0 for r in read_metrics(tmp_path / "served" / "metrics.jsonl")
                                    if r["kind"] == "train")
    assert served == train_rows("local")
    wa, wb = _weights(tmp_path / "served"), _weights(tmp_path / "local")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# -- faults ------------------------------------------------------------------------------------
def _searching_model(model_path: Path, folder: Path, rollout: RolloutSettings) -> Path:
    """The tiny model after a few supervised steps towards replying with a search on every turn
    of a SearchQA episode, so each turn sends a retrieval request (and waits for the slow server)."""
    policy = Policy.from_pretrained(model_path)
    runner = rollout.runner(policy, seed=0, group_size=1)
    scripted, _ = runner.collect([0, 1, 2, 3], policy_version=0, reply_fn=lambda obs, info, env: "<search>capital</search>")
    runner.close()
    samples = [s for r in scripted for s in r.samples]
    opt = torch.optim.Adam(policy.model.parameters(), lr=3e-3)
    policy.model.train()
    for _ in range(25):
        for s in samples:
            ids = torch.as_tensor(s.token_ids)[None]
            labels = torch.where(torch.as_tensor(s.loss_mask)[None] == 1, ids, torch.full_like(ids, -100))
            loss = policy.model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    policy.model.eval()
    return policy.save_pretrained(folder)


@pytest.fixture
def slow_retrieval(search_cache):
    """The real retrieval server on loopback, answering each request after 0.4 s."""
    from envs.search import BM25Retriever
    from envs.search.kb import default_paths
    from envs.search.server import RetrievalServer

    server = RetrievalServer(("127.0.0.1", 0), BM25Retriever(default_paths()["corpus"]), latency=0.4)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_worker_killed_mid_collection_is_replaced_and_no_record_is_lost(cluster, model_path, slow_retrieval,
                                                                          tmp_path, caplog) -> None:
    env_kwargs = {"retrieval_url": slow_retrieval.url, "max_turns": 3, "max_searches": 3, "retrieval_retries": 0}
    rollout = RolloutSettings("freshper/SearchQA-v0", env_kwargs, "window:0", group_size=2, max_new_tokens=8,
                            max_context_tokens=1024)
    path = _searching_model(model_path, tmp_path / "searcher", rollout)
    policy = _fresh_policy(path)
    request = {"seeds": [0, 1, 2, 3], "rng_seed": 5, "group_base": 0}
    expected, stats = ShardedCollector(rollout.runner(policy, seed=0), 2).collect(**request, policy_version=0)
    assert stats["failed"] == 0 and all(len(r.turns) == 3 for r in expected)  # every turn searched the slow server
    collector = RayCollector(policy, path, rollout, workers=2, spec=PolicySpec(), seed=0)
    try:
        victim = _worker_pids(collector)[0]
        start = slow_retrieval.requests
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(out=collector.collect(**request, policy_version=0)))
        with caplog.at_level(logging.WARNING, logger="agents.rollout.workers"):
            thread.start()
            deadline = time.monotonic() + 120
            while slow_retrieval.requests < start + 2 and time.monotonic() < deadline:  # both shards mid-episode
                time.sleep(0.02)
            assert slow_retrieval.requests >= start + 2, "the workers never reached the retrieval server"
            os.kill(victim, signal.SIGKILL)
            thread.join(timeout=300)
        assert not thread.is_alive()
        records, stats = result["out"]
        assert stats["log"]["worker_restarts"] == 1.0
        assert any("rollout worker 0 died" in r.getMessage() for r in caplog.records)
        assert len(records) == 8 and _blobs(records) == _blobs(expected)  # nothing lost, nothing changed
        assert victim not in _worker_pids(collector)
    finally:
        collector.close()


# -- asynchronous collection -------------------------------------------------------------------
def _plan(i: int) -> dict:
    return {"seeds": [100 + 2 * i, 101 + 2 * i], "rng_seed": 7 + i, "group_base": 2 * i}


def test_async_records_carry_the_version_they_were_sampled_with(cluster, model_path, caplog) -> None:
    learner = _fresh_policy(model_path)
    snapshots = {}  # version -> a policy with the weights published as it

    def snapshot() -> Policy:
        # loaded as the workers load theirs: fp32 kernels round by the weights' memory alignment,
        # which a deepcopy changes (records would then differ at ~1e-7)
        copy_ = _fresh_policy(model_path)
        copy_.model.load_state_dict(learner.model.state_dict())
        return copy_

    def publish(collector, version):
        collector.publish(version)
        snapshots[version] = snapshot()

    collector = RayCollector(learner, model_path, LAKE, workers=2, spec=PolicySpec(), seed=0, asynchronous=True, max_staleness=1,
                             steps_per_iteration=1, plan=_plan)

    def expected(i: int, version: int):
        return ShardedCollector(LAKE.runner(snapshots[version], seed=0), 2).collect(**_plan(i),
                                                                                    policy_version=version)[0]

    try:
        snapshots[0] = snapshot()
        first, stats = collector.collect(**_plan(0), policy_version=0)  # nothing ahead yet: sampled now
        assert {r.policy_version for r in first} == {0} and stats["log"]["staleness_max"] == 0.0
        assert _blobs(first) == _blobs(expected(0, 0))
        for it in (1, 2):
            _perturb(learner, seed=it)  # the learner's update ...
            publish(collector, it)  # ... published while iteration it was collected ahead with version it - 1
            records, stats = collector.collect(**_plan(it), policy_version=it)
            assert {r.policy_version for r in records} == {it - 1}
            assert stats["log"]["staleness_mean"] == 1.0 and stats["log"]["stale_dropped"] == 0.0
            assert _blobs(records) == _blobs(expected(it, it - 1))
        # Two updates with no collect in between: iteration 3, collected ahead with version 2, is now
        # 2 steps old (> max_staleness 1): dropped, counted, logged and re-collected with version 4.
        _perturb(learner, seed=3)
        publish(collector, 3)
        _perturb(learner, seed=4)
        publish(collector, 4)
        with caplog.at_level(logging.WARNING, logger="agents.rollout.workers"):
            records, stats = collector.collect(**_plan(3), policy_version=4)
        assert stats["log"]["stale_dropped"] == 4.0 and {r.policy_version for r in records} == {4}
        assert _blobs(records) == _blobs(expected(3, 4))
        assert any("dropping 2 episodes" in r.getMessage() for r in caplog.records)
        # A request off the plan: what was collected ahead (iteration 4) is dropped and counted.
        off = {"seeds": [900, 901], "rng_seed": 1, "group_base": 50}
        records, stats = collector.collect(**off, policy_version=4)
        assert stats["log"]["stale_dropped"] == 4.0 and {r.seed for r in records} == {900, 901}
        assert collector.dropped_total == 8
    finally:
        collector.close()


@pytest.mark.parametrize("replay_ratio", [1, 2])
def test_async_training_keeps_versions_and_buffer_ages_exact(cluster, model_path, tmp_path, replay_ratio) -> None:
    from learner.state import REPLAY_FILE, TrajectoryCodec
    from replay.buffer import ReplayBuffer

    cfg = make_config(runs_root=str(tmp_path), run_name="async", rollout_workers=2, async_collect=True,
                       iterations=4, replay="fresh", replay_batch=4, replay_ratio=replay_ratio,
                       buffer_capacity=16, **TINY)
    learner.run.train(cfg)
    rows = [r for r in read_metrics(tmp_path / "async" / "metrics.jsonl") if r["kind"] == "train"]
    # 1 + K optimizer steps per iteration (on-policy + K replay updates): iteration 1 is sampled
    # fresh, the later ones one iteration (1 + K versions) behind, and updated with IS ratios, not
    # as on-policy
    steps = 1 + replay_ratio
    assert [r["staleness_max"] for r in rows] == [0.0] + [float(steps)] * 3
    assert [r["global_step"] for r in rows] == [steps * i for i in range(1, 5)]
    assert "behavior_logprob_gap" in rows[0] and all("behavior_logprob_gap" not in r for r in rows[1:])
    assert all(r["stale_dropped"] == 0 and math.isfinite(r["loss"]) for r in rows)
    buffer = ReplayBuffer.load(list_checkpoints(tmp_path / "async" / "checkpoints")[-1] / REPLAY_FILE,
                               TrajectoryCodec())
    versions = [item.policy_version for item in buffer._items[: len(buffer)]]
    # iterations 1-4 sampled with versions 0, 0, 1 + K, 2 (1 + K)
    assert versions == [0] * 8 + [steps] * 4 + [2 * steps] * 4
    assert list(buffer._t[: len(buffer)]) == versions  # each stored at the step it was sampled: ages exact
