"""A training run, in the order it happens: :func:`train` is :func:`setup` -> :func:`start_of_rl`
-> :func:`loop` (of :func:`iteration`) -> :func:`finish`.

- setup: the settings resolved once (``learner.config.resolve``), the run folder (new, or the
  one a resume continues), the start model (by default the embedded tiny model pretrained on the
  task's own transitions, cached), the learner (``learner.learners.Learner``: local or sharded,
  chosen by ``learner.build.build_learner``) and the runners; nothing is written before every
  check has passed.
- start of RL: held-out evaluation (the learning claim's baseline), the KL reference,
  checkpoint 0, so a resume never repeats any of it.
- one iteration: collect B tasks x G rollouts with the current policy -> one on-policy update
  -> add the records to the replay buffer -> K replay updates on prioritized batches (PER
  weights applied); the loop adds the periodic held-out evaluation and the checkpoints.
- finish: the last checkpoint, the final evaluations, the summary and curves.

Outputs go to ``runs/<run_name>/`` (docs/training.md). What each step is built from is
``learner/build.py``; the evaluations ``learner/evaluation.py``; the settings ``learner/config.py``.
The loop, the checkpoints and the evaluations see the learner through its interface only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agents.rollout.seeds import EVAL_SEED_BASE, counter_seed, train_seed
from learner import distributed
from learner.build import build_learner, check_reasoning
from learner.checkpoint import (CheckpointError, disk_full, disk_full_error, list_checkpoints, resolve_resume,
                                save_checkpoint)
from learner.config import Config, Resolved, lr_factor, resolve, to_yaml
from learner.evaluation import Evaluations, best_folder, prune_best, restore_best
from learner.learners import Learner
from learner.machine import record_environment, torch_threads
from learner.replay_log import open_replay_log
from learner.report import MetricsLogger, plot_curves, read_metrics, summarize
from learner.state import TrainerState
from learner.trackers import parse_report_to

logger = logging.getLogger("train")


class NonFiniteError(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient."""


def train(cfg: Config) -> dict[str, Any]:
    """The whole job: setup -> start of RL -> loop -> finish; returns the summary."""
    run = setup(cfg)
    try:
        if run.resumed_from is None:
            start_of_rl(run)
        else:
            print(f"resumed from {run.resumed_from} at iteration {run.state.counters.iteration}")
        loop(run)
        return finish(run)
    except FloatingPointError as exc:  # weights or outputs that are no longer finite
        raise NonFiniteError(f"{exc}; at iteration {run.state.counters.iteration} the updates had made the policy "
                             f"not finite: lower --lr. The checkpoints in {run.dir / 'checkpoints'} are intact") from exc
    except Exception as exc:
        if disk_full(exc):
            raise disk_full_error(run.dir, exc) from exc
        raise
    finally:
        run.close()


@dataclass
class Run:
    """What a run holds while it trains (built by :func:`setup`): its resolved settings, folder,
    learner (:class:`learner.learners.Learner`: the policy that samples, the run state, the
    updates), the collector of training episodes, the evaluations and the logs."""

    settings: Resolved
    dir: Path
    learner: Learner
    collector: Any  # agents.rollout.runner.Runner or a collector with its collect contract, B x G rollouts
    evaluations: Evaluations
    metrics: MetricsLogger
    replay_log: Any  # learner.replay_log.ReplayLog (NullReplayLog without replay)
    lock: Any  # learner.checkpoint.RunLock
    resumed_from: Path | None = None
    start_report: dict[str, Any] = field(default_factory=dict)
    wall_start: float = field(default_factory=time.monotonic)

    @property
    def cfg(self) -> Config:
        return self.settings.cfg

    @property
    def policy(self) -> Any:
        """The policy that samples and is evaluated."""
        return self.learner.policy

    @property
    def state(self) -> TrainerState:
        return self.learner.state

    def close(self) -> None:
        self.learner.close()  # a sharded learner's other ranks leave their command loop
        self.collector.close()
        self.evaluations.close()
        self.replay_log.close()
        self.metrics.close()
        self.lock.release()


# -- setup -------------------------------------------------------------------------------------
def setup(cfg: Config) -> Run:
    """Check and resolve the settings (:func:`learner.config.resolve`: the task's default keyword
    arguments, the run name, the policy spec, the threads), then create or reopen the run folder,
    the start model, the learner and the runners. Nothing is written before every check has
    passed; the ``config.yaml`` it writes is the resolved settings, so it says what the run does."""
    import envs
    from agents.rollout.collector import build_collector
    from agents.policies.policy import configure_threads
    from learner.checkpoint import RunLock, loading, verify_resume

    started = time.monotonic()  # the session's wall time counts the start model's pretraining too
    r = resolve(cfg, world=distributed.world_size())
    cfg = r.cfg
    env_id, env_kwargs = cfg.rollout.env_id, cfg.rollout.env_kwargs
    if cfg.rl.train_env_kwargs:  # a curriculum the task cannot build fails here, not at the first collect
        try:
            envs.make(env_id, **r.train_env_kwargs).close()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--train-env-kwargs {json.dumps(cfg.rl.train_env_kwargs)}: {env_id} cannot be built "
                             f"with them: {exc}") from exc
    modality = envs.task_spec(env_id).modality
    if cfg.pretrain.reasoning != "none":
        check_reasoning(cfg, env_kwargs)
    configure_threads(cfg.model.threads)
    resume = resolve_resume(cfg.run.resume) if cfg.run.resume else None
    if resume is not None:
        manifest = verify_resume(resume)
        run_dir = resume.parent.parent
        missing = [p for p in (run_dir / "config.yaml", run_dir / "reference") if not p.exists()]
        if missing:
            raise CheckpointError(f"{resume} is not inside its run folder ({', '.join(map(str, missing))} missing): "
                                  "resume a checkpoint in place, under <run>/checkpoints/")
    else:
        run_dir = Path(cfg.run.runs_root) / cfg.run.run_name
        if list_checkpoints(run_dir / "checkpoints"):
            raise FileExistsError(f"{run_dir} already has checkpoints: pass --resume {run_dir} or another --run-name")
    lock = RunLock(run_dir)
    try:
        model_path, start_report = start_model(cfg, resume, modality, r.update_threads)
        if r.sharded:  # the other ranks build their shards of the same start
            distributed.broadcast(("start", (str(model_path), str(run_dir), None if resume is None else str(resume))))
        seed_everything(cfg.run.seed)
        with loading(model_path):
            learner = build_learner(r, model_path, run_dir)
        policy = learner.policy
        configure_threads(cfg.model.threads, parameters=policy.num_parameters)  # the rollouts' threads
        if policy.is_vision != (modality == "vision"):
            raise ValueError(f"--model {model_path} is a {'vision' if policy.is_vision else 'text'} model but "
                             f"{env_id} is a {modality} task")
        if resume is not None:
            learner.load(resume)
            restore_best(run_dir, learner.state.counters)
        resumed_at = None if resume is None else int(manifest["iteration"])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
        record_environment(run_dir, torch.get_num_threads(), r.update_threads, resumed_at, str(policy.device))
        metrics = MetricsLogger(run_dir, cfg.run.tensorboard, resume_iteration=resumed_at,
                                report_to=parse_report_to(cfg.run.report_to, cfg.run.tensorboard))
        replay = cfg.replay
        replay_log = open_replay_log(run_dir, replay=replay.mode, max_mb=replay.log_mb, reporter=metrics,
                                     resume_iteration=resumed_at,
                                     header={"alpha": replay.alpha, "tau": replay.tau, "replay_ratio": replay.ratio,
                                             "clip": [cfg.loss.clip_low, cfg.loss.clip_high], "env_id": env_id})
        scale = cfg.scale
        training = dataclasses.replace(cfg.rollout, env_kwargs=r.train_env_kwargs)
        collector = build_collector(policy, model_path, training, spec=r.spec, seed=cfg.run.seed,
                                    workers=scale.rollout_workers, shards=scale.rollout_shards,
                                    asynchronous=scale.async_collect, max_staleness=scale.max_staleness,
                                    steps_per_iteration=cfg.steps_per_iteration(),
                                    plan=lambda i: collect_request(cfg, i), start_iteration=learner.state.counters.iteration,
                                    engine=cfg.engine, max_restarts=scale.max_restarts,
                                    log_path=run_dir / "vllm_engine.log", worker_gpus=scale.worker_gpus)
    except BaseException:
        lock.release()
        raise
    evaluations = Evaluations(cfg, run_dir, policy, cfg.rollout.runner(policy, seed=EVAL_SEED_BASE, group_size=1),
                              metrics)
    run = Run(r, run_dir, learner, collector, evaluations, metrics, replay_log, lock, resumed_from=resume,
              start_report=start_report, wall_start=started)
    if resume is not None:
        for row in read_metrics(run_dir / "metrics.jsonl"):
            if row.get("kind") == "eval" and str(row.get("phase")).startswith("baseline"):
                evaluations.evals[row["phase"]] = row
    print(f"run folder: {run_dir} (its settings: {run_dir / 'config.yaml'})")
    return run


def start_model(cfg: Config, resume: Path | None, modality: str, update_threads: int) -> tuple[Path, dict[str, Any]]:
    """The model folder the run starts from, and the report of its pretraining where the
    embedded model was pretrained (or found pretrained in the cache) for it: the checkpoint's on
    resume, else the embedded model pretrained, or built, or ``--model``."""
    if resume is not None:
        return resume / "model", {}
    if cfg.pretrains_embedded_model():
        from learner.pretrain import pretrained_default

        with torch_threads(update_threads):
            return pretrained_default(cfg.rollout.env_id, cfg.rollout.env_kwargs, cfg.pretrain,
                                      seed=cfg.run.model_seed(), micro_batch=cfg.rl.micro(),
                                      progress=cfg.run.progress, device=cfg.model.device, width=cfg.model.tiny_width)
    if cfg.model.model is None:
        from agents.policies.tiny import task_model  # the task's own tokenizer where it has one, as pretrained

        return task_model(cfg.rollout.env_id, cfg.rollout.env_kwargs, seed=cfg.run.model_seed(),
                          width=cfg.model.tiny_width), {}
    from agents.pretrained import resolve_model

    return Path(resolve_model(cfg.model.model)), {}


# -- the start of RL -----------------------------------------------------------------------------
def start_of_rl(run: Run) -> None:
    """Pretrain a given model if asked, evaluate the start of RL (the learning claim's baseline),
    save the KL reference and checkpoint 0, so a resume never repeats any of it."""
    cfg = run.cfg
    if cfg.pretrains_given_model():
        from learner.pretrain import pretrain

        with torch_threads(run.settings.update_threads):
            run.start_report = pretrain(run.policy, cfg.rollout.env_id, cfg.rollout.env_kwargs, cfg.pretrain,
                                        seed=cfg.run.model_seed(), micro_batch=cfg.rl.micro(),
                                        progress=cfg.run.progress)
    if run.start_report:
        rep = run.start_report
        run.metrics.log({"kind": "pretrain", "iteration": 0, "episodes": 0,
                         **{k: v for k, v in rep.items() if isinstance(v, (int, float, bool))}})
        print(f"pretraining on {trained_on(rep, cfg.rollout.env_id)}: {steps_phrase(rep)}{success_phrase(rep)} in "
              f"{rep['pretrain_seconds']:.0f} s{' (cached)' if rep.get('cached') else ''}, loss "
              f"{rep['pretrain_loss_first']:.3f} -> {rep['pretrain_loss_last']:.3f}{exact_phrase(rep, cfg)}")
    run.evaluations.phase("baseline", cfg.eval.final_episodes, cfg.eval.both, run.state.counters)
    run.policy.save_pretrained(run.dir / "reference")  # the KL reference: the policy RL starts from
    write_checkpoint(run)


# -- the loop and one iteration ------------------------------------------------------------------
def loop(run: Run) -> None:
    """The RL loop: iterate until --iterations or --time-budget, evaluating and checkpointing."""
    from tqdm.auto import tqdm

    cfg, c = run.cfg, run.state.counters
    run.learner.reference()  # the KL reference, which start_of_rl wrote, loaded before the first update
    iterations = cfg.run.planned_iterations()
    by_iter = iterations is not None
    budget = cfg.run.time_budget
    bar = tqdm(total=iterations if by_iter else int(budget), initial=c.iteration if by_iter else int(c.rl_seconds),
               unit="it" if by_iter else "s", disable=not cfg.run.progress, dynamic_ncols=True)
    try:
        while (iterations is None or c.iteration < iterations) and (budget is None or c.rl_seconds < budget):
            row = iteration(run)
            run.metrics.log(row)
            if cfg.eval.every and c.iteration % cfg.eval.every == 0:
                ev = run.evaluations.validate(c)
                bar.write(f"iter {c.iteration}: validation success {ev['success']:.2f} "
                          f"[{ev['success_ci_low']:.2f}, {ev['success_ci_high']:.2f}]"
                          f"{' (best so far)' if c.best_iteration == c.iteration else ''}")
            if cfg.run.checkpoint_every and c.iteration % cfg.run.checkpoint_every == 0:
                write_checkpoint(run)
            bar.set_postfix(ret=f"{row['return_mean']:.2f}", succ=f"{row['success']:.2f}",
                            tok_s=f"{row['tokens_per_s']:.0f}")
            bar.update(1 if by_iter else max(0, int(c.rl_seconds) - bar.n))
    finally:
        bar.close()


def iteration(run: Run) -> dict[str, Any]:
    """Collect, update on-policy, add to the buffer, replay; return the iteration's log row."""
    from learner.advantages import assign_advantages
    from learner.update import stepped

    cfg, c, buffer = run.cfg, run.state.counters, run.state.buffer
    it = c.iteration
    if cfg.rl.lr_decay != "none":
        run.state.set_lr(cfg.rl.lr * lr_factor(cfg.rl.lr_decay, it, cfg.run.planned_iterations()))
    seed_everything(counter_seed(cfg.run.seed, it))  # everything random in an iteration follows from its counter
    t0 = time.monotonic()
    # 1. collect B tasks x G rollouts with the current policy, and their advantages
    records, collected = run.collector.collect(**collect_request(cfg, it), policy_version=c.global_step)
    assign_advantages(records, cfg.rl)
    good = [r for r in records if not r.failed]
    t1 = time.monotonic()
    # 2. one update on the fresh records: on-policy (ratio exactly 1) unless asynchronous
    # collection sampled them with older weights (then IS-corrected, with their ages)
    ages = np.array([c.global_step - r.policy_version for r in good], dtype=np.float64)
    upd = update(run, good, np.ones(len(good)), ages, on_policy=not ages.any())
    t2 = time.monotonic()
    # 3. add the records to the buffer (at the step they were sampled), 4. K replay updates
    if buffer is not None and good:
        for version in sorted({r.policy_version for r in good}):
            part = [r for r in good if r.policy_version == version]
            run.replay_log.added(it, version, buffer.add(part, base_priorities(cfg, part), step=version), part)
    c.global_step += int(stepped(upd))
    t_buffer = time.monotonic()
    replays = []
    for _ in range(cfg.replay.ratio if buffer is not None else 0):
        size = cfg.replay.batch or cfg.rl.tasks_per_iter * cfg.rollout.group_size
        batch = buffer.sample(min(size, len(buffer)), step=c.global_step)
        replays.append(update(run, list(batch.items), batch.weights, batch.ages, on_policy=False,
                              observe=run.replay_log.observer(batch.items)))
        run.replay_log.drawn(it, c.global_step, batch, replays[-1], buffer.tau)
        c.global_step += int(stepped(replays[-1]))
        if run.state.tau_controller is not None and run.state.tau_controller.observe(
                replays[-1].get(run.state.tau_controller.metric)):
            buffer.set_tau(run.state.tau_controller.tau)
    t3 = time.monotonic()
    run.learner.publish()  # the sampler takes the new weights (a sharded learner gathers them)
    publish = getattr(run.collector, "publish", None)  # rollout workers / engines take the new weights
    if publish is not None:
        publish(c.global_step)
    check_nonfinite(run, [upd, *replays], it)
    c.iteration += 1
    c.episodes += len(records)
    c.rl_seconds += t3 - t0
    if buffer is not None:
        run.replay_log.end_iteration(it, c, buffer, upd, run.state.tau_controller)
    return log_row(run, records, collected, upd, replays, (t0, t1, t2, t_buffer, t3))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train_seeds(cfg: Config, iteration: int) -> list[int]:
    """Task seeds of one iteration: a function of the iteration counter (exact resume)."""
    b_tasks = cfg.rl.tasks_per_iter
    return [train_seed(cfg.run.seed, iteration, b_tasks, b) for b in range(b_tasks)]


def collect_request(cfg: Config, iteration: int) -> dict[str, Any]:
    """What iteration ``iteration`` collects: its task seeds, sampling seed and first group id
    (an asynchronous collector starts later iterations from this plan)."""
    return {"seeds": train_seeds(cfg, iteration), "rng_seed": counter_seed(cfg.run.seed, iteration),
            "group_base": iteration * cfg.rl.tasks_per_iter}


def update(run: Run, trajs: list, weights, ages, on_policy: bool, observe=None) -> dict[str, Any]:
    """One optimizer step on ``trajs`` (every rank's part of it under torchrun)."""
    return run.learner.update(trajs, weights, ages, on_policy=on_policy, observe=observe)


def base_priorities(cfg: Config, records: list) -> np.ndarray:
    from replay.priorities import abs_advantage_priority, abs_return_priority

    if cfg.replay.priority == "return":
        return abs_return_priority([r.episode_return for r in records], cfg.replay.eps)
    return abs_advantage_priority([r.advantage for r in records], cfg.replay.eps)


def check_nonfinite(run: Run, updates: list[dict[str, Any]], it: int) -> None:
    c = run.state.counters
    for st in updates:
        c.nonfinite_consecutive = c.nonfinite_consecutive + 1 if st["skipped"] else 0
        c.nonfinite_total += int(st["skipped"])
        if st["skipped"]:
            logger.warning("iteration %d: non-finite %s, update skipped (%d in a row)", it, st.get("nonfinite"),
                           c.nonfinite_consecutive)
        if c.nonfinite_consecutive >= run.cfg.rl.max_nonfinite:
            raise NonFiniteError(
                f"{c.nonfinite_consecutive} consecutive updates had a non-finite loss or gradient "
                f"(last: {st.get('nonfinite')}); stopping. The last good checkpoint is intact in "
                f"{run.dir / 'checkpoints'}; lower --lr, check --kl-coef, or inspect the data.")


def log_row(run: Run, records: list, collected: dict[str, float], upd: dict[str, Any], replays: list[dict[str, Any]],
            times: tuple[float, ...]) -> dict[str, Any]:
    c, buffer = run.state.counters, run.state.buffer
    t0, t1, t2, t_buffer, t3 = times
    groups: dict[int, list[float]] = {}
    for r in records:
        if not r.failed:
            groups.setdefault(r.group_id, []).append(r.episode_return)
    row: dict[str, Any] = {
        "kind": "train", "iteration": c.iteration, "episodes": c.episodes, "global_step": c.global_step,
        "return_mean": collected["mean_return"], "success": collected["success_rate"],
        "invalid_rate": collected["invalid_reply_rate"], "turns_mean": collected["mean_turns"],
        "groups_all_equal": sum(1 for g in groups.values() if np.ptp(g) == 0), "groups": len(groups),
        "failed_records": int(collected["failed"]), "nonfinite_total": c.nonfinite_total,
        "lr": float(run.state.optimizer.param_groups[0]["lr"]),
        **{k: v for k, v in upd.items() if isinstance(v, float)},
        "time_rollout_s": t1 - t0, "time_update_s": t2 - t1, "time_buffer_s": t_buffer - t2,
        "time_replay_s": t3 - t_buffer,
        "time_total_s": c.rl_seconds, "tokens_per_s": upd.get("seq_tokens", 0.0) / max(t2 - t1, 1e-9),
        **collected.get("log", {}),  # distributed collection: worker restarts, stale drops, staleness
    }
    if replays:
        for k in sorted({k for st in replays for k in st if isinstance(st[k], float)}):
            row[f"replay_{k}" if not k.startswith("ess") else k] = float(np.mean([st[k] for st in replays if k in st]))
        ages = buffer.age_stats(c.global_step)
        row.update(buffer_size=ages["size"], buffer_age_mean=ages.get("age_mean", 0.0),
                   buffer_age_max=ages.get("age_max", 0.0), tau=buffer.tau)
        if ages.get("age_hist") is not None:
            row["buffer_age_hist"] = ages["age_hist"]
            row["buffer_age_mass"] = ages["age_mass"]
    return row


def write_checkpoint(run: Run) -> Path:
    def write(folder: Path) -> None:
        run.learner.save(folder)  # the model and the run state (a sharded learner's shards on every rank)
        (folder / "config.yaml").write_text(to_yaml(run.cfg), encoding="utf-8")

    c = run.state.counters
    path = save_checkpoint(run.dir / "checkpoints", c.iteration, write, keep=run.cfg.run.keep_checkpoints)
    prune_best(run.dir, c.best_iteration, c.iteration)
    return path


# -- the end of the run --------------------------------------------------------------------------
def finish(run: Run) -> dict[str, Any]:
    """Last checkpoint, final evaluation, the selected policy's evaluation, summary, curves."""
    cfg, c = run.cfg, run.state.counters
    best = cfg.eval.select == "best"
    if best and cfg.eval.every and c.best_iteration != c.iteration \
            and (c.iteration % cfg.eval.every or c.best_iteration < 0):
        run.evaluations.validate(c)  # the last iteration is a candidate too (a time budget ends anywhere)
    newest = list_checkpoints(run.dir / "checkpoints")
    if not newest or newest[-1].name != f"iter_{c.iteration:06d}":
        write_checkpoint(run)
    run.evaluations.phase("final", cfg.eval.final_episodes, cfg.eval.both, c)
    selected = None
    if best and 0 <= c.best_iteration < c.iteration:
        from agents.policies.weights import load_weights_into

        selected = best_folder(run.dir, c.best_iteration)
        run.learner.release()  # after the last checkpoint nothing trains on: free Adam's state first
        load_weights_into(run.policy, selected / "model")  # in place: no second copy of the model
        run.evaluations.phase("selected", cfg.eval.final_episodes, cfg.eval.both, c,
                              {"policy_iteration": c.best_iteration})
    summary = summarize(run.evaluations.evals, dataclasses.asdict(c), time.monotonic() - run.wall_start)
    summary["agent"] = str((selected or list_checkpoints(run.dir / "checkpoints")[-1]) / "model")
    summary["selected_iteration"] = c.best_iteration if selected is not None else c.iteration
    start = pretrain_line(run)
    if start:
        summary["text"] += "\n" + start
    summary["text"] += (f"\nthe agent: {summary['agent']} (iteration {summary['selected_iteration']}"
                        + (f", the best validation success {c.best_success:.2f} of the periodic evaluations; "
                           "'final' rows: the last iteration" if selected is not None else ", the last") + ")")
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (run.dir / "summary.txt").write_text(summary["text"] + "\n", encoding="utf-8")
    plot_curves(run.dir / "metrics.jsonl", run.dir / "curves.png", title=summary["verdict"])
    print(summary["text"])
    return summary


def steps_phrase(rep: dict[str, Any]) -> str:
    """``"2000 steps (the last 400 following the subgoal words)"``: the steps of a pretraining
    report, and of its follow stage where it had one."""
    follow = rep.get("pretrain_follow_steps")
    return f"{rep['pretrain_steps']} steps" + (f" (the last {follow} following the subgoal words)" if follow else "")


def success_phrase(rep: dict[str, Any]) -> str:
    """``", imitating 812 successful random episodes of 16,400"``: where the pretraining
    imitated random play's successes (``--pretrain-success``), how many it found and in how
    many random episodes in all; empty elsewhere."""
    found = rep.get("pretrain_successes_imitated")
    return f", imitating {found:,} successful random episodes of {rep['pretrain_episodes']:,}" if found else ""


def trained_on(rep: dict[str, Any], task: str) -> str:
    """What a pretraining report's examples were: the model's own answers, or the task's transitions."""
    return f"its own answers to {task}'s prompts" if "pretrain_own_usable" in rep else f"{task}'s transitions"


def exact_phrase(rep: dict[str, Any], cfg: Config) -> str:
    """How well the pretrained model writes held-out next states, and how that stands to the
    bar, from a pretraining report (the start line and the summary say it alike)."""
    if "pretrain_own_usable" in rep:  # the own-answer warm-up writes no next states
        return f", {rep['pretrain_own_usable']:.0%} of the model's direct answers usable"
    if "pretrain_dynamics_exact_after" not in rep:
        return ""
    phrase = f", held-out next states written exactly {rep['pretrain_dynamics_exact_after']:.2f}"
    if "pretrain_reached_bar" in rep:
        phrase += f" ({'reached' if rep['pretrain_reached_bar'] else 'below'} the bar {cfg.pretrain.recipe().until_exact:.2f})"
    return phrase


def pretrain_line(run: Run) -> str:
    """The summary's line on the start model's pretraining (from this session's report, or the
    run's ``pretrain`` metrics record after a resume); empty without pretraining."""
    rep = run.start_report
    path = run.dir / "metrics.jsonl"
    if not rep and path.exists():
        with open(path, encoding="utf-8") as fh:
            rep = next((r for r in map(json.loads, fh) if r.get("kind") == "pretrain"), {})
    if not rep:
        return ""
    took = f"; {rep['pretrain_seconds']:.0f} s of this session" if run.start_report and not rep.get("cached") \
        and "pretrain_seconds" in rep else ""
    return (f"the start: pretrained {steps_phrase(rep)} on {trained_on(rep, 'the task')}{success_phrase(rep)}"
            f"{' (cached)' if rep.get('cached') else ''}{exact_phrase(rep, run.cfg)}{took}")
