"""The learner end to end on tiny settings: config/CLI, the first on-policy update, zero-signal
groups, non-finite updates, exact resume, corrupt checkpoints, text and image tasks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import learner.run
import learner.update
import train
from agents.record import load_records
from agents.rollout.runner import default_env_kwargs
from learner.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint
from learner.cli import field_docs
from learner.config import (Config, build_parser, flatten, locked_on_resume, make_config, parse_config,
                            section_classes, settings, validate)
from learner.loss import LossSettings
from learner.update import policy_update
from learner.report import compare_runs, read_metrics

REPO = Path(__file__).resolve().parents[2]

#: Tiny, fast, deterministic settings (B=2, G=2, short replies, tiny evaluations).
TINY = dict(tasks_per_iter=2, group_size=2, max_new_tokens=4, pretrain_steps=0, eval_every=2, eval_episodes=2,
            final_eval_episodes=2, checkpoint_every=2, progress=False, tensorboard=False, threads=1)


def tiny_config(tmp_path: Path, **overrides) -> Config:
    return make_config(runs_root=str(tmp_path), **{**TINY, **overrides})


@pytest.fixture(scope="module")
def text_setup():
    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from agents.policies.tiny import build_tiny_model
    from learner.advantages import assign_group_advantages

    torch.manual_seed(0)
    policy = Policy.from_pretrained(build_tiny_model("text"))
    runner = Runner(policy, "freshper/FrozenLake-v0", group_size=2, max_new_tokens=4, seed=3)
    records, _ = runner.collect([11, 12], policy_version=0)
    assign_group_advantages(records)
    return policy, records


def _optimizer(policy):
    opt = torch.optim.Adam(policy.model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def _params(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.model.parameters()]


# -- config ------------------------------------------------------------------------------------
def test_every_config_field_is_documented_and_a_flag() -> None:
    help_text = build_parser().format_help()
    flags = set(settings(Config()))
    for section, cls in section_classes().items():
        docs = field_docs(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.metadata.get("setting", True)]
        assert set(names) <= set(docs), f"undocumented fields of {section}: {set(names) - set(docs)}"
        others = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("setting", True)]
        assert set(others) <= {"max_grad_norm", "check_every", "seed"}, f"fields of {section} that are no setting: {others}"
    for name in flags | set(FLAGS_BEFORE_THE_NESTED_CONFIG):
        assert "--" + name.replace("_", "-") in help_text
    # the flags of the flat config are settings still, or --is-weights, a shorthand of two of them
    assert flags | {"is_weights"} >= set(FLAGS_BEFORE_THE_NESTED_CONFIG), set(FLAGS_BEFORE_THE_NESTED_CONFIG) - flags
    assert flatten({"is_weights": "classical"}) == {"is_target": "uniform", "is_normalize": "buffer"}
    assert set(locked_on_resume()) == set(LOCKED_BEFORE_THE_NESTED_CONFIG) - {"is_weights"} | {"is_target", "is_normalize"}


#: The settings (flags, YAML keys) of train.py when its config was one flat class: each still works.
FLAGS_BEFORE_THE_NESTED_CONFIG = """run_name runs_root seed start_seed device dtype gradient_checkpointing lora_rank lora_alpha
    lora_targets lora_dropout threads update_threads env_id env_kwargs train_env_kwargs context model max_new_tokens
    max_context_tokens temperature tiny_width pretrain_steps pretrain_batch pretrain_lr pretrain_dynamics pretrain_observe
    pretrain_seconds pretrain_until_exact pretrain_max_steps pretrain_follow_steps pretrain_success pretrain_follow
    reasoning think_loss tasks_per_iter group_size iterations time_budget advantage gigpo_gamma step_weight loss clip_low
    clip_high dual_clip tis_cap sequence_ratio kl_coef lr lr_warmup_steps lr_decay adam_beta1 adam_beta2 max_grad_norm
    micro_batch max_nonfinite replay replay_ratio replay_batch buffer_capacity priority priority_eps alpha tau
    tau_target_ess tau_signal tau_target_clip beta beta_final is_weights beta_anneal_steps eval_every eval_episodes select
    final_eval_episodes eval_greedy eval_both diagnostics checkpoint_every keep_checkpoints resume tensorboard report_to
    replay_log_mb progress gifs rollout_workers rollout_shards async_collect max_staleness max_restarts worker_gpus engine
    vllm_python vllm_args""".split()
#: ... and those a resume refused to change then, as it does now.
LOCKED_BEFORE_THE_NESTED_CONFIG = """env_id env_kwargs train_env_kwargs context model tiny_width seed start_seed tasks_per_iter
    group_size pretrain_steps pretrain_batch pretrain_lr pretrain_dynamics pretrain_observe pretrain_seconds
    pretrain_until_exact pretrain_max_steps pretrain_follow_steps pretrain_follow pretrain_success pretrain_replies reasoning system_prompt lora_rank
    lora_alpha lora_targets lora_dropout advantage gigpo_gamma step_weight replay buffer_capacity priority priority_eps
    alpha tau tau_target_ess tau_signal tau_target_clip is_weights beta beta_final beta_anneal_steps lr_decay runs_root
    run_name""".split()


def test_settings_nest_under_their_section_in_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"replay": {"tau": 5, "capacity": 320, "ratio": 1}, "pretrain": {"steps": 3},
                                    "lr": 1e-4, "loss": "tis"}))
    cfg = parse_config(["--config", str(path), "--replay-batch", "8"])
    assert (cfg.replay.tau, cfg.replay.capacity, cfg.replay.ratio, cfg.replay.batch) == (5.0, 320, 1, 8)
    assert (cfg.pretrain.steps, cfg.rl.lr, cfg.loss.loss, cfg.replay.mode) == (3, 1e-4, "tis", "fresh")
    assert settings(cfg)["buffer_capacity"] == 320 and settings(cfg)["pretrain_steps"] == 3
    path.write_text("replay:\n  capasity: 5\n")
    with pytest.raises(ValueError, match="did you mean replay.capacity"):
        parse_config(["--config", str(path)])
    path.write_text("pretrain:\n  max_grad_norm: 5\n")  # not a setting of its own: --max-grad-norm is
    with pytest.raises(ValueError, match="unknown config keys: pretrain.max_grad_norm"):
        parse_config(["--config", str(path)])
    assert make_config(max_grad_norm=0.5).pretrain.max_grad_norm == 0.5
    assert make_config(seed=7).replay.seed == 7


def test_every_archived_run_config_loads() -> None:
    """The run folders the docs' tables and plots are rebuilt from keep their config.yaml loadable."""
    from learner.cli import load_config_file
    from learner.config import config_from_dict

    paths = sorted((REPO / "docs" / "data").rglob("config.yaml"))
    assert paths
    for path in paths:
        saved = flatten(load_config_file(path))  # --is-weights as the two settings it sets
        back = settings(config_from_dict(saved))
        assert all(back[k] == v for k, v in saved.items() if k != "vllm_args"), path
        assert back["vllm_args"] == (saved.get("vllm_args") or {}), path


def test_yaml_config_then_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"replay": "fresh", "tau": 7.5, "lr": 1e-4}))
    cfg = parse_config(["--config", str(path), "--lr", "2e-4", "--dual-clip", "none", "--env-kwargs", '{"size": 4}'])
    assert (cfg.replay.mode, cfg.replay.tau, cfg.rl.lr, cfg.loss.dual_clip, cfg.rollout.env_kwargs) == ("fresh", 7.5, 2e-4, None, {"size": 4})


def test_unknown_yaml_key_and_bad_values_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("replay_ration: 2\n")
    with pytest.raises(ValueError, match="did you mean replay_ratio"):
        parse_config(["--config", str(path)])
    with pytest.raises(ValueError, match="--replay must be"):
        parse_config(["--replay", "prioritized"])


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = parse_config(["--config", str(path)])
    assert cfg.rollout.env_id.startswith("freshper/")
    import envs

    envs.make(cfg.rollout.env_id, **dict(cfg.rollout.env_kwargs or {})).close()  # the task takes the config's keyword arguments


def test_a_config_with_a_width_and_a_model_folder_says_how_to_combine_them(tmp_path: Path) -> None:
    """configs/searchqa.yaml sizes the embedded model (tiny_width 256); a user who brings a model
    folder to it is told to reset the width rather than having one of the two settings ignored."""
    config = str(REPO / "configs" / "searchqa.yaml")
    assert parse_config(["--config", config]).model.tiny_width == 256
    with pytest.raises(ValueError, match=r"configs/searchqa.yaml, add --tiny-width 128"):
        validate(parse_config(["--config", config, "--model", str(tmp_path)]))
    validate(parse_config(["--config", config, "--model", str(tmp_path), "--tiny-width", "128"]))


def test_the_default_config_file_is_the_default_run_written_out() -> None:
    # configs/frozenlake_default.yaml documents what `make train` (train.py without flags) runs:
    # every value it sets must be train.py's default, so a changed default cannot leave it behind
    written = yaml.safe_load((REPO / "configs" / "frozenlake_default.yaml").read_text(encoding="utf-8"))
    default = parse_config([])
    from_file = parse_config(["--config", str(REPO / "configs" / "frozenlake_default.yaml")])

    def resolved(cfg, key):  # the values train.py fills in at start where the flag is left unset
        value = settings(cfg)[key]
        if key == "env_kwargs" and value is None:
            return default_env_kwargs(cfg.rollout.env_id, cfg.rollout.context)
        if key == "pretrain_steps" and value is None:
            return cfg.pretrain.recipe().steps
        if key == "pretrain_until_exact" and value is None:
            return cfg.pretrain.recipe().until_exact
        if key == "iterations":
            return cfg.run.planned_iterations()
        return value

    differ = {k: (resolved(from_file, k), resolved(default, k)) for k in written
              if resolved(from_file, k) != resolved(default, k)}
    assert not differ, f"configs/frozenlake_default.yaml differs from train.py's defaults: {differ}"


def test_board_tasks_in_window0_default_to_the_board_alone() -> None:
    assert default_env_kwargs("freshper/FrozenLake-v0", "window:0") == {"feedback": False}
    assert default_env_kwargs("freshper/Sokoban-v0", "window:0") == {"feedback": False}
    assert default_env_kwargs("freshper/FrozenLake-v0", "window:2") == {}  # feedback is history there
    assert default_env_kwargs("freshper/FrozenLake-v0", "full") == {}
    assert default_env_kwargs("freshper/SearchQA-v0", "window:0") == {}  # its feedback is the retrieval


# -- updates on real records --------------------------------------------------------------------
def test_first_on_policy_update_has_ratio_exactly_one(text_setup) -> None:
    policy, records = text_setup
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    opt, sched = _optimizer(policy)
    n = len(records)
    stats = policy_update(policy, None, opt, sched, records, np.ones(n), np.zeros(n), loss_cfg=LossSettings(), on_policy=True)
    policy.model.load_state_dict(state)
    assert stats["ratio_mean"] == 1.0 and stats["ratio_max"] == 1.0 and stats["ratio_min"] == 1.0
    assert stats["clip_frac"] == 0.0
    # ... because the stored behaviour log-probs are those of the same weights (up to fp32 noise).
    assert stats["behavior_logprob_gap"] < 1e-4


def test_all_equal_groups_give_zero_gradient_and_leave_weights_unchanged(text_setup) -> None:
    policy, records = text_setup
    flat = [dataclasses.replace(r, advantage=0.0) for r in records]
    before = _params(policy)
    opt, sched = _optimizer(policy)
    n = len(flat)
    stats = policy_update(policy, None, opt, sched, flat, np.ones(n), np.zeros(n), loss_cfg=LossSettings(), on_policy=False)
    assert stats["grad_norm"] == 0.0
    for a, b in zip(before, policy.model.parameters()):
        assert torch.equal(a, b)


def test_nonfinite_loss_skips_the_update(text_setup) -> None:
    """A replayed record with corrupt (NaN) behaviour log-probs makes the loss NaN: skip it."""
    policy, records = text_setup
    bad = records[0]
    sample = dataclasses.replace(bad.samples[0], behavior_logprobs=bad.samples[0].behavior_logprobs.copy())
    sample.behavior_logprobs[sample.loss_mask == 1] = np.nan
    broken = [dataclasses.replace(bad, samples=[sample] + bad.samples[1:], advantage=1.0)] + records[1:]
    before = _params(policy)
    opt, sched = _optimizer(policy)
    n = len(broken)
    stats = policy_update(policy, None, opt, sched, broken, np.ones(n), np.ones(n), loss_cfg=LossSettings(), on_policy=False)
    assert stats["skipped"] == 1.0 and stats["nonfinite"] == "loss"
    for a, b in zip(before, policy.model.parameters()):
        assert torch.equal(a, b)


def test_a_replay_update_reads_the_reference_log_probs_the_first_update_kept(text_setup) -> None:
    """The first update of a record keeps the KL reference's log-probs on its samples; a later
    update of it (a replay update) reads them instead of running the reference, with the same
    loss and gradients; they survive the record's own serialisation (replay checkpoints) and are
    not used under another temperature."""
    import copy

    from agents.record import Trajectory

    policy, records = text_setup
    ref = copy.deepcopy(policy)
    ref.model.requires_grad_(False)
    calls = []
    real = learner.update.reference_logprobs
    kept = copy.deepcopy(records)
    fresh = copy.deepcopy(records)
    for r in kept + fresh:
        r.advantage = r.advantage or 0.5
    n = len(records)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    cfg = LossSettings(kl_coef=0.5)

    def update(recs, keep, temperature=1.0):
        stats = policy_update(policy, ref, opt, None, recs, np.ones(n), np.ones(n), loss_cfg=cfg, on_policy=False,
                              temperature=temperature, keep_reference_logprobs=keep)
        return stats, [p.grad.clone() for p in policy.model.parameters() if p.grad is not None]

    learner.update.reference_logprobs = lambda *a: calls.append(1) or real(*a)
    try:
        update(kept, True)  # the first scoring keeps them
        assert all(s.reference_logprobs is not None for r in kept for s in r.samples if s.num_sampled)
        first = len(calls)
        stats, grads = update(kept, True)
        assert len(calls) == first  # the reference did not run again
        want_stats, want_grads = update(fresh, False)
        assert abs(stats["loss"] - want_stats["loss"]) < 1e-6 and abs(stats["kl"] - want_stats["kl"]) < 1e-6
        for a, b in zip(grads, want_grads):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        update(kept, True, temperature=0.7)  # another key: the reference runs
        assert len(calls) > first
    finally:
        learner.update.reference_logprobs = real
    sample = next(s for r in kept for s in r.samples if s.num_sampled)
    assert sample.reference_key.startswith("temperature=0.7;")
    back = Trajectory.from_bytes(kept[0].to_bytes())
    for a, b in zip(back.samples, kept[0].samples):
        assert a.reference_key == b.reference_key
        assert (a.reference_logprobs is None) == (b.reference_logprobs is None)
        if a.reference_logprobs is not None:
            assert np.array_equal(a.reference_logprobs, b.reference_logprobs)
            assert np.all(a.reference_logprobs[a.loss_mask == 0] == 0)


# -- whole runs ------------------------------------------------------------------------------------
def _train_rows(run_dir: Path) -> list[dict]:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] in ("train", "eval")]
    return [{k: v for k, v in r.items() if not ("time" in k or k.endswith("per_s"))} for r in rows]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model" / "model.safetensors"))


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """4 iterations in one go == 2 iterations, stop, resume, 2 more: same metrics and weights."""
    kw = dict(iterations=4, replay="fresh", replay_ratio=1, replay_batch=4, buffer_capacity=8, kl_coef=0.04,
              pretrain_steps=1, pretrain_batch=4)
    learner.run.train(tiny_config(tmp_path, run_name="whole", **kw))
    learner.run.train(tiny_config(tmp_path, run_name="split", **{**kw, "iterations": 2}))
    resumed = parse_config(["--resume", str(tmp_path / "split"), "--iterations", "4"])
    assert resumed.replay.mode == "fresh" and resumed.run.iterations == 4
    learner.run.train(resumed)
    whole, split = tmp_path / "whole", tmp_path / "split"
    rows_whole = [r for r in _train_rows(whole) if not str(r.get("phase", "")).startswith("final")]
    rows_split = [r for r in _train_rows(split) if not str(r.get("phase", "")).startswith("final")]
    assert [r["iteration"] for r in rows_split if r["kind"] == "train"] == [1, 2, 3, 4]
    assert rows_whole == rows_split
    wa, wb = _weights(list_checkpoints(whole / "checkpoints")[-1]), _weights(list_checkpoints(split / "checkpoints")[-1])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # The default FrozenLake run observes the board alone after a move (window:0, markov_state).
    assert yaml.safe_load((whole / "config.yaml").read_text())["env_kwargs"] == {"feedback": False}
    later_turns = [t.observation for r in load_records(whole / "eval" / "final") for t in r.turns[1:]]
    assert later_turns and not any("Turns left" in o or "You moved" in o for o in later_turns)
    # The run's outputs are all there.
    for name in ("config.yaml", "metrics.jsonl", "curves.png", "summary.json", "eval/final/records.jsonl"):
        assert (whole / name).exists(), name
    assert any(r["kind"] == "train" and "ess/age_1-2" in r for r in read_metrics(whole / "metrics.jsonl"))
    # What the floating-point results depend on is recorded per start: one entry, then one per resume.
    env_whole = json.loads((whole / "environment.json").read_text())
    env_split = json.loads((split / "environment.json").read_text())
    assert len(env_whole) == 1 and env_whole[0]["resumed_at_iteration"] is None
    assert [e["resumed_at_iteration"] for e in env_split] == [None, 2]
    assert env_split[1]["packages"]["torch"] == torch.__version__.split("+")[0]
    assert env_split[1]["packages"]["transformers"] and env_split[1]["update_threads"] >= 1
    assert env_split[1]["device"] == "cpu" and "gpu" not in env_split[1]
    # Side-by-side comparison of finished runs (python -m learner.report).
    final = json.loads((whole / "summary.json").read_text())["evals"]["final"]["success"]
    text = compare_runs({"a": [whole], "b": [whole, split]}, tmp_path / "cmp.png", window=2)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["setting", "run", "iterations"] and len(lines) == 2 + 2 + 3
    assert f"{final:.3f}" in lines[2] and lines[3].split()[:2] == ["a", "mean"]
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


def test_the_run_delivers_the_policy_that_validates_best(tmp_path: Path) -> None:
    """Periodic evaluations run on validation seeds; the best policy is kept in best/iter_N, scored
    on the test tasks beside the last iteration, named as the run's agent, and kept on resume."""
    from agents.rollout.seeds import EVAL_SEED_BASE, VALID_SEED_BASE

    # A 2x2 lake without holes: any well-formed moves reach the goal, so the briefly pretrained
    # start succeeds; a learning rate of 1.0 given on resume then wrecks its replies.
    kw = dict(env_kwargs={"size": 2, "p": 1.0, "feedback": False}, pretrain_steps=80, pretrain_batch=8,
              max_new_tokens=16, eval_episodes=8, final_eval_episodes=8, iterations=2)
    learner.run.train(tiny_config(tmp_path, run_name="r", **kw))
    run = tmp_path / "r"
    assert [p.name for p in list_checkpoints(run / "best")] == ["iter_000002"]
    summary = learner.run.train(parse_config(["--resume", str(run), "--iterations", "4", "--lr", "1.0"]))
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval"]
    valid = {r["iteration"]: r["success"] for r in rows if r.get("split") == "validation"}
    assert sorted(valid) == [2, 4] and valid[2] > valid[4]
    assert {r["first_task_seed"] for r in rows if r.get("split") == "validation"} == {VALID_SEED_BASE}
    assert {r["first_task_seed"] for r in rows if r.get("split") is None} == {EVAL_SEED_BASE}
    assert summary["selected_iteration"] == 2 and summary["agent"] == str(run / "best" / "iter_000002" / "model")
    assert "the agent: " + summary["agent"] in summary["text"]
    # The kept policy is iteration 2's weights exactly, and nothing newer is kept.
    assert [p.name for p in list_checkpoints(run / "best")] == ["iter_000002"]
    kept, at2 = _weights(run / "best" / "iter_000002"), _weights(run / "checkpoints" / "iter_000002")
    assert kept.keys() == at2.keys() and all(torch.equal(kept[k], at2[k]) for k in kept)
    # It is scored on the test tasks beside the last iteration, and the verdict is its own.
    evals = summary["evals"]
    assert {"final", "final_greedy", "selected", "selected_greedy"} <= evals.keys()
    assert evals["selected"]["success"] > evals["final"]["success"] and evals["selected"]["policy_iteration"] == 2
    assert summary["verdict"].startswith(f"sampled success: selected {evals['selected']['success']:.2f}")
    assert (run / "eval" / "selected" / "records.jsonl").exists()
    # --select last delivers the last iteration (and is checked like any setting).
    last = learner.run.train(tiny_config(tmp_path, run_name="last", **{**kw, "select": "last"}))
    assert last["selected_iteration"] == 2 and "selected" not in last["evals"]
    with pytest.raises(ValueError, match="--select"):
        validate(tiny_config(tmp_path, run_name="bad", select="first"))


def test_a_resume_keeps_the_best_policy_its_state_points_to(tmp_path: Path) -> None:
    """A best policy written after the checkpoint a run resumes from is dropped (the run replays
    that stretch); the one the restored state names is kept; a missing one is picked again."""
    from learner.checkpoint import save_checkpoint
    from learner.evaluation import restore_best
    from learner.state import Counters

    run = tmp_path / "r"
    for it in (10, 20, 30):
        save_checkpoint(run / "best", it, lambda tmp: (tmp / "w").write_text("x"), keep=99)
    (run / "best" / ".tmp-iter_000040-1").mkdir()  # a write cut short
    state = Counters(iteration=25, best_iteration=20, best_success=0.5)
    restore_best(run, state)
    assert [p.name for p in (run / "best").iterdir()] == ["iter_000020"]
    assert (state.best_iteration, state.best_success) == (20, 0.5)
    gone = Counters(iteration=25, best_iteration=10, best_success=0.4)
    restore_best(run, gone)
    assert (gone.best_iteration, gone.best_success) == (-1, -1.0)


def test_lr_decay_follows_the_iterations_and_resumes_exactly(tmp_path: Path) -> None:
    kw = dict(iterations=4, lr=1e-3, lr_decay="linear", pretrain_steps=1, pretrain_batch=4, eval_every=0)
    learner.run.train(tiny_config(tmp_path, run_name="whole", **kw))
    # Resumed from its checkpoint at iteration 2, a run continues on the same schedule.
    learner.run.train(tiny_config(tmp_path, run_name="split", **kw, checkpoint_every=2))
    half = tmp_path / "split" / "checkpoints" / "iter_000002"
    with pytest.raises(ValueError, match="--lr-decay linear runs over them"):
        parse_config(["--resume", str(half), "--iterations", "6"])
    learner.run.train(parse_config(["--resume", str(half)]))
    rows = {n: [r for r in _train_rows(tmp_path / n) if r["kind"] == "train"] for n in ("whole", "split")}
    assert [r["lr"] for r in rows["whole"]] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert rows["whole"] == rows["split"]
    from learner.config import lr_factor

    assert lr_factor("cosine", 0, 4) == 1.0 and lr_factor("cosine", 2, 4) == pytest.approx(0.5)
    assert lr_factor("none", 3, 4) == 1.0
    with pytest.raises(ValueError, match="--lr-decay"):
        validate(tiny_config(tmp_path, run_name="bad", lr_decay="step"))
    with pytest.raises(ValueError, match="--lr-decay follows the iterations"):
        validate(tiny_config(tmp_path, run_name="bad", lr_decay="linear", iterations=None, time_budget=60))


def test_image_task_trains_end_to_end_with_replay(tmp_path: Path) -> None:
    summary = learner.run.train(tiny_config(tmp_path, run_name="vision", env_id="freshper/FrozenLakeVision-v0", iterations=2,
                                      replay="fresh", replay_batch=4, eval_every=0, tensorboard=True, gifs=1))
    run = tmp_path / "vision"
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 2 and all(r["skipped"] == 0.0 and math.isfinite(r["loss"]) for r in rows)
    assert "replay_loss" in rows[-1] and rows[-1]["buffer_size"] == 8
    assert list((run / "eval" / "final").glob("episode_*.gif"))
    assert list((run / "tensorboard").glob("events.*"))
    assert summary["iterations"] == 2


def test_repeated_nonfinite_updates_stop_the_run_and_keep_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    # A loss that is NaN on every update (valid settings cannot cause it, so it is injected).
    import learner.update

    real = learner.update.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(learner.update, "grpo_loss", nan_loss)
    cfg = tiny_config(tmp_path, run_name="nan", iterations=5, max_nonfinite=2, replay="none")
    with pytest.raises(learner.run.NonFiniteError, match="consecutive"):
        learner.run.train(cfg)
    ckpts = list_checkpoints(tmp_path / "nan" / "checkpoints")
    assert [c.name for c in ckpts] == ["iter_000000"]
    verify_checkpoint(ckpts[0])
    assert train.main(["--resume", str(tmp_path / "nan"), "--iterations", "5"]) == 2  # stops again, cleanly


def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    learner.run.train(tiny_config(tmp_path, run_name="c", iterations=2, eval_every=0))
    ckpt = list_checkpoints(tmp_path / "c" / "checkpoints")[-1]
    weights = ckpt / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its checksum"):
        learner.run.train(parse_config(["--resume", str(tmp_path / "c")]))
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(ckpt)


# -- every task trains from the embedded default ------------------------------------------------
@pytest.mark.parametrize("env_id", ["freshper/FrozenLake-v0", "freshper/FrozenLakeVision-v0", "freshper/Sokoban-v0",
                                    "freshper/SokobanVision-v0", "freshper/SearchQA-v0"])
def test_every_task_trains_from_the_pretrained_embedded_default(tmp_path: Path, env_id: str, monkeypatch) -> None:
    """Sokoban with its config's think tag and a follow stage (two pretraining stages, the first
    cached on its own); SearchQA imitating random play's successes, as its config does; the
    others with the bare reply."""
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    follow, search = env_id == "freshper/Sokoban-v0", env_id == "freshper/SearchQA-v0"
    extra = dict(reasoning="subgoal", pretrain_follow_steps=2, max_new_tokens=8) if follow else dict(max_new_tokens=6)
    if search:
        extra["pretrain_success"] = 1.0
    summary = learner.run.train(tiny_config(tmp_path, run_name="t", env_id=env_id, iterations=2, pretrain_steps=2,
                                      pretrain_batch=4, eval_every=0, gifs=0, **extra))
    rows = read_metrics(tmp_path / "t" / "metrics.jsonl")
    (pre,) = [r for r in rows if r["kind"] == "pretrain"]
    assert pre["pretrain_steps"] == (4 if follow else 2) and not pre["cached"]
    trains = [r for r in rows if r["kind"] == "train"]
    assert len(trains) == 2 and all(math.isfinite(r["loss"]) and r["skipped"] == 0.0 for r in trains)
    assert summary["iterations"] == 2 and "final" in summary["evals"]
    steps = "4 steps (the last 2 following the subgoal words)" if follow else "2 steps"
    text = (tmp_path / "t" / "summary.txt").read_text(encoding="utf-8")
    imitated = ""
    if search:  # the successes it imitated, and the random episodes it took to find them
        assert pre["pretrain_successes_imitated"] >= 1 and pre["pretrain_episodes"] > pre["pretrain_successes_imitated"]
        imitated = (f", imitating {pre['pretrain_successes_imitated']:,} successful random episodes of "
                    f"{pre['pretrain_episodes']:,}")
    assert f"the start: pretrained {steps} on the task's transitions{imitated}, held-out next states written exactly" \
        in text
    if follow:
        assert pre["pretrain_follow_steps"] == 2
        assert len(list((tmp_path / "cache").glob("pretrained-Sokoban-v0-s0-*"))) == 2  # the first stage too



def test_the_default_pretraining_goes_on_until_it_writes_next_states_and_a_given_recipe_does_not() -> None:
    from learner.pretrain import DEFAULT_PRETRAIN_EXACT

    assert make_config().pretrain.recipe().until_exact == DEFAULT_PRETRAIN_EXACT == 0.5
    assert make_config().pretrain.recipe().max_steps == 0  # 4x the steps
    assert make_config(pretrain_steps=400).pretrain.recipe().until_exact == 0.0
    given = make_config(pretrain_steps=50, pretrain_until_exact=0.3, pretrain_max_steps=90).pretrain.recipe()
    assert (given.steps, given.until_exact, given.max_steps) == (50, 0.3, 90)
    assert make_config(pretrain_until_exact=0.0).pretrain.recipe().until_exact == 0.0
    with pytest.raises(ValueError, match="--pretrain-until-exact"):
        validate(make_config(pretrain_until_exact=2.0))
    with pytest.raises(ValueError, match="--pretrain-max-steps"):
        validate(make_config(pretrain_max_steps=100))
    assert "pretrain_until_exact" in locked_on_resume() and "pretrain_max_steps" in locked_on_resume()
    follow = make_config(reasoning="subgoal", pretrain_follow_steps=40, pretrain_follow=0.25).pretrain.recipe()
    assert (follow.follow_steps, follow.follow_fraction) == (40, 0.25)
    with pytest.raises(ValueError, match="--pretrain-follow-steps needs --reasoning subgoal"):
        validate(make_config(reasoning="lookahead", pretrain_follow_steps=40))
    with pytest.raises(ValueError, match="--pretrain-follow"):
        validate(make_config(reasoning="subgoal", pretrain_follow_steps=40, pretrain_follow=1.5))
    assert "pretrain_follow_steps" in locked_on_resume() and "pretrain_follow" in locked_on_resume()


def test_turn_level_advantages_train_and_replay(tmp_path: Path) -> None:
    learner.run.train(tiny_config(tmp_path, run_name="g", iterations=2, advantage="gigpo", replay="fresh", replay_batch=4,
                            pretrain_steps=2, pretrain_batch=4, eval_every=0))
    rows = [r for r in read_metrics(tmp_path / "g" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 2 and "replay_loss" in rows[-1]
    with pytest.raises(ValueError, match="gigpo needs a window"):
        validate(make_config(advantage="gigpo", context="full"))


def test_lookahead_reasoning_trains_end_to_end_and_is_refused_where_a_task_has_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    summary = learner.run.train(tiny_config(tmp_path, run_name="look", iterations=2, reasoning="lookahead", pretrain_steps=2,
                                      pretrain_batch=4, eval_every=0, gifs=0, max_new_tokens=16))
    assert summary["iterations"] == 2 and "action_spread" in summary["evals"]["final"]
    (pre,) = [r for r in read_metrics(tmp_path / "look" / "metrics.jsonl") if r["kind"] == "pretrain"]
    assert pre["pretrain_steps"] == 2 and pre["pretrain_format_nll_after"] > 0
    (marker,) = (tmp_path / "cache").glob("pretrained-FrozenLake-v0-*/freshper_pretrain.json")
    assert json.loads(marker.read_text())["recipe"]["reasoning"] == "lookahead"
    learner.run.train(tiny_config(tmp_path, run_name="look2", iterations=1, reasoning="lookahead", pretrain_steps=2,
                            pretrain_batch=4, eval_every=0, gifs=0, max_new_tokens=16, think_loss=False))
    with pytest.raises(ValueError, match="SearchQAEnv does not implement lookahead_text"):
        learner.run.train(tiny_config(tmp_path, run_name="sqa", env_id="freshper/SearchQA-v0", reasoning="lookahead"))
    assert not (tmp_path / "sqa").exists()  # refused before the run folder was made


def test_state_reasoning_trains_the_image_task_end_to_end(tmp_path: Path, monkeypatch) -> None:
    """``--reasoning state`` on FrozenLakeVision: the pretraining's format replies transcribe the
    image, the run trains from that model, and its diagnostics score answers after the true
    board text (the recipe is part of the cached model's key)."""
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    summary = learner.run.train(tiny_config(tmp_path, run_name="state", env_id="freshper/FrozenLakeVision-v0", iterations=1,
                                      reasoning="state", think_loss=False, pretrain_steps=2, pretrain_batch=4,
                                      eval_every=0, gifs=0, max_new_tokens=32))
    assert summary["iterations"] == 1 and "action_spread" in summary["evals"]["final"]
    (marker,) = (tmp_path / "cache").glob("pretrained-FrozenLakeVision-v0-*/freshper_pretrain.json")
    assert json.loads(marker.read_text())["recipe"]["reasoning"] == "state"
    with pytest.raises(ValueError, match="--reasoning must be none|lookahead|state"):
        validate(make_config(reasoning="board"))


def test_no_think_loss_leaves_the_think_span_out_of_the_loss_and_its_token_count() -> None:
    from agents.record import Sample, Trajectory, Turn
    from learner.batch import make_batches

    o, c = 516, 517
    closed = Sample([1, 2, o, 5, 6, c, 7, 8, 3], [0, 0, 1, 1, 1, 1, 1, 1, 1], [0.0, 0.0] + [-0.5] * 7)
    unclosed = Sample([1, 2, o, 5, 6], [0, 0, 1, 1, 1], [0.0, 0.0, -0.5, -0.5, -0.5])
    plain = Sample([1, 2, 7, 8], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.5])
    traj = Trajectory("x/Y-v0", 0, 0, [Turn("o", "r", 0.0, True)] * 3, [closed, unclosed, plain], 0.0, False, 0,
                      advantage=1.0)
    (full,) = make_batches([traj])
    (batch,) = make_batches([traj], skip_span=(o, c))
    # the unclosed reply (no answer: an invalid one) keeps its tokens, so the format penalty trains them
    assert full.num_tokens == 7 + 3 + 2 and batch.num_tokens == 3 + 3 + 2
    assert batch.size == 3
    assert batch.mask[0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert batch.behavior_logprobs[0].tolist() == [0.0] * 6 + [-0.5] * 3
    assert batch.mask[1].tolist()[:5] == [0, 0, 1, 1, 1]
    assert batch.mask[2].tolist()[:4] == [0, 0, 1, 1]


def test_a_curriculum_changes_the_training_tasks_and_not_the_held_out_ones(tmp_path: Path) -> None:
    """--train-env-kwargs: training levels are the easier ones, evaluation stays on the task."""
    import envs
    from agents.rollout.seeds import EVAL_SEED_BASE

    cfg = tiny_config(tmp_path, run_name="cur", env_id="freshper/Sokoban-v0", iterations=1, eval_every=0,
                      train_env_kwargs={"max_solution_moves": 2})
    run = learner.run.setup(cfg)
    cfg = run.cfg  # the resolved settings: the task's keyword arguments filled in
    try:
        trained, _ = run.collector.collect(**learner.run.collect_request(cfg, 0), policy_version=0)
        held_out, _ = run.evaluations.runner.collect([EVAL_SEED_BASE + k for k in range(6)], policy_version=0)
    finally:
        run.close()

    def level(seed: int, **extra) -> tuple[str, int]:
        env = envs.make("freshper/Sokoban-v0", **{**cfg.rollout.env_kwargs, **extra})
        obs, _ = env.reset(seed=seed)
        return obs["text"], env.unwrapped.optimal_moves

    for r in trained:
        text, moves = level(r.seed, max_solution_moves=2)
        assert r.turns[0].observation == text and moves <= 2
    levels = [level(r.seed) for r in held_out]
    assert [r.turns[0].observation for r in held_out] == [t for t, _ in levels]
    assert max(m for _, m in levels) > 2  # the task's own levels, not the curriculum's
    assert yaml.safe_load((tmp_path / "cur" / "config.yaml").read_text())["train_env_kwargs"] == {"max_solution_moves": 2}
    with pytest.raises(ValueError, match="--train-env-kwargs"):
        learner.run.setup(tiny_config(tmp_path, run_name="bad", env_id="freshper/Sokoban-v0",
                                train_env_kwargs={"max_solution_moves": 99}))
    assert not (tmp_path / "bad").exists()


# -- resume and run folders -------------------------------------------------------------------------
def test_resume_refuses_settings_that_shaped_the_run_and_applies_the_rest(tmp_path: Path) -> None:
    learner.run.train(tiny_config(tmp_path, run_name="r", iterations=2, replay="fresh", replay_batch=4, eval_every=0))
    run = str(tmp_path / "r")
    for flags, name in ((["--replay", "per"], "--replay"), (["--tau", "1000"], "--tau"),
                        (["--buffer-capacity", "10"], "--buffer-capacity"), (["--env-id", "freshper/Sokoban-v0"], "--env-id"),
                        (["--model", "x"], "--model"), (["--seed", "3"], "--seed"),
                        (["--train-env-kwargs", '{"size": 3}'], "--train-env-kwargs")):
        with pytest.raises(ValueError, match=f"cannot change {name}"):
            parse_config(["--resume", run, *flags])
        assert train.main(["--resume", run, *flags]) == 2
    first = torch.load(list_checkpoints(tmp_path / "r" / "checkpoints")[-1] / "trainer.pt", weights_only=True)
    assert all(tuple(g["betas"]) == (0.9, 0.999) for g in first["optimizer"]["param_groups"])
    cfg = parse_config(["--resume", run, "--iterations", "3", "--lr", "0.05", "--adam-beta1", "0"])
    assert (cfg.rl.lr, cfg.rl.adam_beta1, cfg.run.iterations, cfg.replay.mode) == (0.05, 0.0, 3, "fresh")
    learner.run.train(cfg)
    ckpt = list_checkpoints(tmp_path / "r" / "checkpoints")[-1]
    saved = torch.load(ckpt / "trainer.pt", weights_only=True)
    # the flags took effect, although the restored optimizer brought its own lr and betas back
    assert all(g["lr"] == pytest.approx(0.05) for g in saved["optimizer"]["param_groups"])
    assert all(tuple(g["betas"]) == (0.0, 0.999) for g in saved["optimizer"]["param_groups"])
    assert yaml.safe_load((ckpt / "config.yaml").read_text())["lr"] == 0.05
    with pytest.raises(ValueError, match="--adam-beta1"):
        parse_config(["--adam-beta1", "1.0"])


def test_resume_outside_its_run_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    import shutil

    learner.run.train(tiny_config(tmp_path, run_name="r", iterations=2, eval_every=0))
    d = tmp_path / "d"
    (d / "ck").mkdir(parents=True)
    shutil.copy(tmp_path / "r" / "config.yaml", d / "config.yaml")
    shutil.copy(tmp_path / "r" / "metrics.jsonl", d / "metrics.jsonl")
    shutil.copytree(list_checkpoints(tmp_path / "r" / "checkpoints")[-1], d / "ck" / "iter_000002")
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    assert train.main(["--resume", str(d / "ck" / "iter_000002")]) == 2
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before


def test_a_second_writer_of_a_run_folder_is_refused_and_stale_temporaries_are_cleared(tmp_path: Path) -> None:
    from learner.checkpoint import RunLock

    run = tmp_path / "dup"
    stale = run / "checkpoints" / ".tmp-iter_000004-999999"
    stale.mkdir(parents=True)
    lock = RunLock(run)  # what a running train.py holds
    assert not stale.exists()
    try:
        with pytest.raises(FileExistsError, match="in use by train.py pid"):
            learner.run.train(tiny_config(tmp_path, run_name="dup", iterations=1))
        assert train.main(["--runs-root", str(tmp_path), "--run-name", "dup", "--iterations", "1", "--no-progress"]) == 2
    finally:
        lock.release()
    assert not (run / "metrics.jsonl").exists()  # the refused run wrote nothing


@pytest.mark.parametrize("flags, name", [
    (["--replay", "fresh", "--tau", "0"], "--tau"), (["--replay", "fresh", "--alpha", "-1"], "--alpha"),
    (["--replay", "fresh", "--buffer-capacity", "0"], "--buffer-capacity"), (["--lr", "nan"], "--lr"),
    (["--lr", "-1"], "--lr"), (["--lr", "inf"], "--lr"), (["--group-size", "1"], "--group-size"),
    (["--replay-ratio", "-1"], "--replay-ratio"), (["--iterations", "0"], "--iterations"),
    (["--iterations", "-3"], "--iterations"), (["--time-budget", "-1"], "--time-budget"),
    (["--replay", "fresh", "--replay-batch", "100000"], "--replay-batch"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--run-name", "../../x"], "--run-name"), (["--run-name", "/tmp/abs"], "--run-name"),
    (["--kl-coef", "-0.1"], "--kl-coef"), (["--reasoning", "chain"], "--reasoning"),
])
def test_bad_settings_are_refused_before_any_work_naming_the_flag(flags, name, capsys) -> None:
    with pytest.raises(ValueError, match=name):
        parse_config(flags)
    assert train.main(flags) == 2
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("device", ["tpu", "cuda:x"] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]))
def test_a_device_torch_cannot_use_is_refused_before_any_work(device, capsys) -> None:
    with pytest.raises(ValueError, match="--device"):
        parse_config(["--device", device])
    assert train.main(["--device", device]) == 2
    assert "--device" in capsys.readouterr().err
    assert parse_config(["--device", "auto"]).model.device == "auto"  # auto always resolves (CPU without CUDA)


def test_yaml_values_of_the_wrong_type_are_refused_naming_the_flag(tmp_path: Path) -> None:
    for text, name in (('eval_both: "false"\n', "--eval-both"), ('micro_batch: "8"\n', "--micro-batch"),
                       ("lr: [1]\n", "--lr")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=name):
            parse_config(["--config", str(path)])
    path.write_text("lr: 1\neval_both: false\n")  # an int where a float is wanted is fine
    assert parse_config(["--config", str(path)]).rl.lr == 1.0


def test_a_learning_rate_that_blows_the_weights_up_stops_the_run_cleanly(tmp_path: Path, capsys) -> None:
    args = ["--runs-root", str(tmp_path), "--run-name", "big", "--iterations", "3", "--lr", "1e30", "--tasks-per-iter", "2",
            "--group-size", "4", "--pretrain-steps", "15", "--pretrain-batch", "16", "--pretrain-lr", "3e-3", "--eval-every", "0",
            "--final-eval-episodes", "2", "--no-progress", "--no-tensorboard", "--threads", "1"]
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "not finite" in err and "--lr" in err
    verify_checkpoint(list_checkpoints(tmp_path / "big" / "checkpoints")[-1])


def test_openmp_threads_spin_only_when_the_machine_is_idle_at_start(monkeypatch) -> None:
    from learner import machine

    def load(value):
        def getloadavg():
            if value is None:
                raise OSError("no load average")
            return (value, value, value)
        return getloadavg

    # what other work keeps busy now decides, whatever the load average says (it stays high for
    # minutes after make's set-up or a test run has ended)
    monkeypatch.setattr(machine.os, "getloadavg", load(1.9))
    for busy, policy in ((0.0, "ACTIVE"), (0.3, "ACTIVE"), (0.7, "PASSIVE"), (1.8, "PASSIVE")):
        monkeypatch.setattr(machine, "busy_cores", lambda busy=busy: busy)
        assert machine.default_omp_wait_policy() == policy
    # without /proc/stat, the load average
    monkeypatch.setattr(machine, "busy_cores", lambda: None)
    for value, policy in ((0.1, "ACTIVE"), (0.6, "PASSIVE"), (1.9, "PASSIVE"), (None, "PASSIVE")):
        monkeypatch.setattr(machine.os, "getloadavg", load(value))
        assert machine.default_omp_wait_policy() == policy
    # train.py chooses it in main(), before torch (and the OpenMP runtime it loads) is imported;
    # importing train chooses nothing
    import subprocess
    import sys

    code = ("import os, sys\n"
            "seen = []\n"
            "sys.addaudithook(lambda event, args: event == 'import' and args[0] == 'torch' and not seen"
            " and seen.append(os.environ.get('OMP_WAIT_POLICY')))\n"
            "import train\n"
            "assert 'torch' not in sys.modules and 'OMP_WAIT_POLICY' not in os.environ\n"
            "try:\n    train.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(seen[0], os.environ['OMP_WAIT_POLICY'])\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    chosen, now = out.stdout.split()[-2:]
    assert chosen in ("ACTIVE", "PASSIVE") and chosen == now


def test_busy_cores_sees_a_process_that_keeps_a_core_busy() -> None:
    import subprocess
    import sys

    from learner.machine import busy_cores

    idle = busy_cores(0.3)
    if idle is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        import time

        time.sleep(0.3)
        busy = busy_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and busy > 0.6 and busy > idle


def test_a_wider_embedded_model_trains_and_keeps_its_own_cached_folders(tmp_path: Path, monkeypatch) -> None:
    """``--tiny-width`` builds a wider decoder (heads of 32) in folders of its own, pretrains and
    trains it; the default width keeps its folder names, and a width with --model is refused."""
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    from agents.policies.tiny import build_tiny_model, check_width

    summary = learner.run.train(tiny_config(tmp_path, run_name="w", tiny_width=192, iterations=1, pretrain_steps=2,
                                      pretrain_batch=4, eval_every=0, gifs=0))
    assert summary["iterations"] == 1
    written = json.loads((tmp_path / "w" / "reference" / "config.json").read_text(encoding="utf-8"))
    assert (written["hidden_size"], written["num_attention_heads"], written["num_key_value_heads"],
            written["intermediate_size"]) == (192, 6, 3, 576)
    wide = list((tmp_path / "cache").glob("tiny-text-s0-w192-*"))
    assert len(wide) == 1 and len(list((tmp_path / "cache").glob("pretrained-FrozenLake-v0-s0-*"))) == 1
    default = build_tiny_model("text", cache_dir=tmp_path / "cache")
    assert "-w" not in default.name and default != wide[0]
    assert json.loads((default / "config.json").read_text(encoding="utf-8"))["hidden_size"] == 128
    from agents.policies.policy import Policy  # the vision model's merger projects into the wider decoder

    vision = Policy.from_pretrained(build_tiny_model("vision", cache_dir=tmp_path / "cache", width=192))
    image = np.zeros((112, 112, 3), np.uint8)
    (gen,) = vision.generate([vision.chat.first_message("look: <image>", [image])], [[image]], max_new_tokens=3)
    assert len(gen.token_ids) == 3 and vision.model.config.text_config.hidden_size == 192
    with pytest.raises(ValueError, match="multiple of 64"):
        check_width(100)
    with pytest.raises(ValueError, match="--tiny-width sizes the embedded model"):
        learner.run.train(tiny_config(tmp_path, run_name="m", tiny_width=256, model=str(default)))
    with pytest.raises(ValueError, match="--tiny-width must be a multiple of 64"):
        learner.run.train(tiny_config(tmp_path, run_name="m", tiny_width=96))


def test_runs_of_two_seeds_with_one_start_seed_share_one_pretrained_start(tmp_path: Path, monkeypatch) -> None:
    """``--start-seed`` seeds the start model alone: two runs of different --seed values with the
    same --start-seed pretrain once and start from identical weights; without it each --seed
    builds its own start, and a resume refuses to change it."""
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    from safetensors.torch import load_file

    def run(name: str, **kw) -> dict:
        return learner.run.train(tiny_config(tmp_path, run_name=name, iterations=1, pretrain_steps=2, pretrain_batch=4,
                                       eval_every=0, gifs=0, **kw))

    first, second = run("a", seed=1, start_seed=0), run("b", seed=2, start_seed=0)
    assert first["iterations"] == second["iterations"] == 1
    starts = sorted(p.name for p in (tmp_path / "cache").glob("pretrained-FrozenLake-v0-s*"))
    assert len(starts) == 1 and starts[0].startswith("pretrained-FrozenLake-v0-s0-")
    ref_a = load_file(str(tmp_path / "a" / "reference" / "model.safetensors"))
    ref_b = load_file(str(tmp_path / "b" / "reference" / "model.safetensors"))
    assert ref_a.keys() == ref_b.keys() and all(torch.equal(ref_a[k], ref_b[k]) for k in ref_a)
    run("c", seed=1)  # no --start-seed: the run's own seed builds its start
    assert len(list((tmp_path / "cache").glob("pretrained-FrozenLake-v0-s1-*"))) == 1
    with pytest.raises(ValueError, match="cannot change --start-seed"):
        parse_config(["--resume", str(tmp_path / "a"), "--start-seed", "3", "--iterations", "2"])
    with pytest.raises(ValueError, match="--start-seed must be"):
        validate(parse_config(["--start-seed", "-1"]))


def test_a_figure_task_run_checks_its_policy_with_another_problems_picture(tmp_path: Path, monkeypatch) -> None:
    """A figure task's phases (start of RL, final) are also played with each picture another
    problem's (``envs.capabilities.OtherPicture``), and the summary says whether the policy reads
    the picture; the validations and the other decoding's evaluations are not."""
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    kw = {"preset": "grid_value", "image_size": [140, 140], "max_attempts": 1}
    summary = learner.run.train(tiny_config(tmp_path, run_name="chart", env_id="freshper/ChartQA-v0", env_kwargs=kw,
                                            iterations=1, eval_every=0, final_eval_episodes=6, eval_both=True,
                                            pretrain_steps=2, pretrain_batch=4, pretrain_dynamics=0.5,
                                            pretrain_observe=0.5, pretrain_success=1.0))
    evals = summary["evals"]
    for key in ("baseline", "final"):
        assert 0.0 <= evals[key]["other_picture_ci_low"] <= evals[key]["other_picture_success"] \
            <= evals[key]["other_picture_ci_high"] <= 1.0
    assert not any("other_picture_success" in e for k, e in evals.items() if e["decoding"] == "greedy")
    assert summary["reads_board"] in (True, False) and "picture reading: success" in summary["verdict"]
    assert "other picture " in summary["text"]
    # its recipe's pretraining (observe examples and imitated successes, as configs/chartqa_grid_value.yaml)
    # trains no next-state examples, so the start line does not quote their held-out rate
    start = next(line for line in summary["text"].splitlines() if line.startswith("the start: pretrained 2 steps"))
    assert "imitating" in start and "next states" not in start
    rows = [r for r in read_metrics(tmp_path / "chart" / "metrics.jsonl") if r["kind"] == "eval"]
    assert any("other_picture_success" in r for r in rows)
