"""A run is put together from settings resolved once, behind one learner interface: setup leaves
the caller's config alone, the loop and the evaluations see the learner only, the update is
called in one place and the learner package has no import circle."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import learner.run
from learner.config import Resolved, make_config, resolve
from learner.learners import Learner, LocalLearner

REPO = Path(__file__).resolve().parents[2]
TINY = dict(tasks_per_iter=2, group_size=2, max_new_tokens=4, pretrain_steps=0, eval_every=0, eval_episodes=2,
            final_eval_episodes=2, checkpoint_every=0, progress=False, tensorboard=False, threads=1)


def _learner_imports() -> dict[str, set[str]]:
    out = {}
    for path in sorted((REPO / "learner").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        out[name] = found
    return {m: {i for i in imps if i in out and i != m} for m, imps in out.items()}


def test_the_learner_package_imports_without_a_circle() -> None:
    """Every import, those inside functions and type-checking ones included: evaluation.py is
    handed what it needs, it does not import run.py; the two scoring paths share
    learner/prompts.py instead of importing each other."""
    graph = _learner_imports()
    assert "learner.run" not in graph["learner.evaluation"]
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError(" -> ".join(path[path.index(node):] + [node]))
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, path + [node])
        done.add(node)

    for module in graph:
        visit(module, [])


def test_policy_update_is_called_in_one_place() -> None:
    calls = []
    for path in sorted((REPO / "learner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "policy_update":
                calls.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("learner/learners.py"), calls


def test_resolve_fills_what_the_start_decides_and_leaves_the_config_alone() -> None:
    cfg = make_config(dtype="auto", lora_rank=4, **TINY)
    before = dataclasses.asdict(cfg)
    r = resolve(cfg, now="20260101-000000")
    assert dataclasses.asdict(cfg) == before  # the caller's settings are not changed
    assert r.cfg.run.run_name == "FrozenLake-v0__s0__20260101-000000"
    assert r.cfg.rollout.env_kwargs == cfg.rollout.task_kwargs() and cfg.rollout.env_kwargs is None
    assert r.spec.compute_dtype == torch.float32 and r.spec.lora_rank == 4
    assert r.update_threads >= 1 and r.world == 1 and not r.sharded
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.world = 2  # type: ignore[misc]
    assert resolve(cfg, world=2).update_threads <= max(1, r.update_threads)
    assert isinstance(r, Resolved)


def test_the_run_trains_through_its_learner(tmp_path: Path) -> None:
    """setup builds a LocalLearner; an update through it steps the optimizer and changes the
    sampled-from policy; save and load round-trip the run state."""
    cfg = make_config(runs_root=str(tmp_path), run_name="l", iterations=1, kl_coef=0.04, lr_warmup_steps=0, **TINY)
    run = learner.run.setup(cfg)
    try:
        assert isinstance(run.learner, LocalLearner)
        assert all(callable(getattr(run.learner, m)) for m in
                   ("update", "publish", "reference", "save", "load", "release", "close"))
        assert run.policy is run.learner.policy and run.state is run.learner.state
        assert run.evaluations.policy is run.learner.policy
        assert run.cfg.run.run_name == "l" and run.cfg.rollout.env_kwargs is not None
        records, _ = run.collector.collect(**learner.run.collect_request(run.cfg, 0), policy_version=0)
        good = [r for r in records if not r.failed]
        for k, r in enumerate(good):  # a signal whatever the returns were
            r.advantage = 1.0 if k % 2 else -1.0
        before = [p.detach().clone() for p in run.policy.model.parameters()]
        run.policy.save_pretrained(run.dir / "reference")  # what start_of_rl writes
        ref = run.learner.reference()
        assert ref is not None and ref is run.learner.reference()  # loaded once
        stats = run.learner.update(good, np.ones(len(good)), np.zeros(len(good)), on_policy=True)
        assert stats["skipped"] == 0.0
        assert any(not torch.equal(a, b) for a, b in zip(before, run.policy.model.parameters()))
        run.state.counters.global_step = 1
        run.learner.save(tmp_path / "ckpt")
        run.state.counters.global_step = 99
        run.learner.load(tmp_path / "ckpt")
        assert run.state.counters.global_step == 1
        assert (tmp_path / "ckpt" / "model" / "config.json").is_file()
        run.learner.release()
        assert not run.state.optimizer.state
    finally:
        run.close()


def test_the_learner_protocol_names_what_the_run_uses() -> None:
    names = {n for n in dir(Learner) if not n.startswith("_")}
    assert {"update", "publish", "reference", "save", "load", "release", "close"} <= names


def test_every_settings_section_is_named_settings() -> None:
    from learner.config import section_classes

    assert all(cls.__name__.endswith("Settings") for cls in section_classes().values()), \
        {k: cls.__name__ for k, cls in section_classes().items()}
