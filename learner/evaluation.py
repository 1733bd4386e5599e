"""A run's held-out evaluations (:class:`Evaluations`, given what they need: the settings, the
run folder, the policy, a runner of held-out tasks and the metrics log): the periodic
validations that pick the policy it delivers (``--select best``, kept in
``<run>/best/iter_N/model``), and the test-task evaluations of the start of RL, the end and the
selected policy (``<run>/eval/<phase>/``)."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agents.rollout.seeds import EVAL_SEED_BASE, VALID_SEED_BASE
from learner.checkpoint import checkpoint_name, clean_stale_temporaries, list_checkpoints, save_checkpoint
from learner.config import Config
from learner.report import MetricsLogger, task_turn_diagnostics

logger = logging.getLogger("train")

BEST_DIR = "best"


def best_folder(run_dir: Path, iteration: int) -> Path:
    return run_dir / BEST_DIR / checkpoint_name(iteration)


def prune_best(run_dir: Path, best_iteration: int, upto: int) -> None:
    """Delete kept policies that the run state no longer points to: older than its best, and
    (after a resume) newer than ``upto``, the iteration it resumed from (they are re-made as the
    run replays, or not, if the run takes another course)."""
    for folder in list_checkpoints(run_dir / BEST_DIR):
        it = int(folder.name.split("_")[-1])
        if it != best_iteration and (it < best_iteration or it > upto):
            shutil.rmtree(folder, ignore_errors=True)


def restore_best(run_dir: Path, counters) -> None:
    """On resume: keep the best policy the restored state points to, drop later ones; if it is
    gone (deleted by hand), say so and pick the best again from the validations still to come."""
    clean_stale_temporaries(run_dir / BEST_DIR)
    prune_best(run_dir, counters.best_iteration, counters.iteration)
    if counters.best_iteration >= 0 and not best_folder(run_dir, counters.best_iteration).is_dir():
        logger.warning("the best policy of iteration %d is missing from %s: the run picks its best again from the "
                       "next validations on", counters.best_iteration, run_dir / BEST_DIR)
        counters.best_iteration, counters.best_success = -1, -1.0


@dataclass
class Evaluations:
    """What a run's evaluations need and what they found: ``runner`` plays held-out tasks (group
    size 1) with ``policy``; ``evals`` holds each phase's row (the summary reads them)."""

    cfg: Config
    dir: Path
    policy: Any
    runner: Any  # agents.rollout.runner.Runner
    metrics: MetricsLogger
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)

    def validate(self, counters) -> dict[str, Any]:
        """A periodic evaluation on the validation tasks; with ``--select best``, keep the policy
        if it is the best so far (ties: the later one) in ``best/iter_N/model``, written
        atomically, and point ``counters`` at it."""
        cfg, c = self.cfg, counters
        ev = self.run_eval(cfg.eval.episodes, f"iter_{c.iteration}", seed=VALID_SEED_BASE)[0]
        self.metrics.log({"kind": "eval", "iteration": c.iteration, "episodes": c.episodes, "split": "validation", **ev})
        if cfg.eval.select == "best" and ev["success"] >= c.best_success:
            save_checkpoint(self.dir / BEST_DIR, c.iteration, lambda tmp: self.policy.save_pretrained(tmp / "model"),
                            keep=1 << 30)
            c.best_iteration, c.best_success = c.iteration, float(ev["success"])
        return ev

    def run_eval(self, episodes: int, tag: str, greedy: bool | None = None,
                 seed: int = EVAL_SEED_BASE, other_picture: bool = False) -> tuple[dict[str, Any], list]:
        """Evaluate on held-out tasks (seeds from ``seed``: the test tasks' EVAL_SEED_BASE unless
        given the validation tasks' VALID_SEED_BASE; neither ever trained on); return a flat
        dict (success with its 95% Wilson CI, return, invalid rate, turns, the task's probes and
        the policy diagnostics) and the records. With ``other_picture`` (a phase's evaluation in
        the run's decoding, the one its verdicts read) and the diagnostics on, a task that can show another problem's picture
        (:class:`envs.capabilities.OtherPicture`) is also played so on the same seeds:
        ``other_picture_success`` and its interval."""
        from agents.evaluate import evaluate
        from learner.diagnostics import policy_diagnostics

        cfg = self.cfg
        env_id, env_kwargs = cfg.rollout.env_id, cfg.rollout.env_kwargs
        greedy = cfg.eval.greedy if greedy is None else greedy
        result = evaluate(self.policy, env_id, episodes=episodes, seed=seed, greedy=greedy, runner=self.runner)
        out: dict[str, Any] = {
            "phase": tag, "decoding": "greedy" if greedy else "sampled", "episodes_eval": result.episodes,
            "first_task_seed": seed, "success": result.success_rate, "success_ci_low": result.success_ci[0],
            "success_ci_high": result.success_ci[1], "return_mean": result.mean_return,
            "return_ci_low": result.return_ci[0], "return_ci_high": result.return_ci[1],
            "invalid_rate": result.invalid_reply_rate, "turns_mean": result.mean_turns,
            "failed_eval": int(result.stats.get("failed", 0)),
        }
        out.update(task_turn_diagnostics(env_id, result.records, env_kwargs))
        if cfg.eval.diagnostics and not greedy:
            out.update(policy_diagnostics(self.policy, env_id, env_kwargs, temperature=cfg.rollout.temperature,
                                          reasoning=cfg.pretrain.reasoning))
        if cfg.eval.diagnostics and other_picture:
            out.update(self.other_picture_eval(episodes, greedy, seed))
        return out, result.records

    def other_picture_eval(self, episodes: int, greedy: bool, seed: int) -> dict[str, Any]:
        """Success on the same held-out tasks with each episode's picture another problem's
        (``{}`` for tasks without :class:`envs.capabilities.OtherPicture`): a policy that reads
        the picture falls there to what a picture-blind one scores."""
        import envs
        from agents.evaluate import evaluate
        from envs.capabilities import other_picture_kwargs

        rollout = self.cfg.rollout
        try:
            swap = other_picture_kwargs(envs.task_class(rollout.env_id))
        except TypeError:  # a task registered by a factory function: no class to ask
            return {}
        if not swap:
            return {}
        settings = replace(rollout, env_kwargs={**rollout.task_kwargs(), **swap})
        runner = settings.runner(self.policy, seed=seed, group_size=1)
        try:
            result = evaluate(self.policy, rollout.env_id, episodes=episodes, seed=seed, greedy=greedy, runner=runner)
        finally:
            runner.close()
        return {"other_picture_success": result.success_rate, "other_picture_ci_low": result.success_ci[0],
                "other_picture_ci_high": result.success_ci[1]}

    def phase(self, tag: str, episodes: int, both: bool, counters, extra: dict[str, Any] | None = None) -> None:
        """Run the evaluation of a phase (and, if ``both``, the other decoding mode too), log (with
        ``extra``) and save it."""
        from agents.evaluate import save_gifs
        from agents.record import save_records

        cfg, c = self.cfg, counters
        modes = [cfg.eval.greedy] + ([not cfg.eval.greedy] if both else [])
        for k, greedy in enumerate(modes):
            key = tag if k == 0 else f"{tag}_{'greedy' if greedy else 'sampled'}"
            self.evals[key], records = self.run_eval(episodes, key, greedy, other_picture=k == 0)
            self.evals[key].update(extra or {})
            self.metrics.log({"kind": "eval", "iteration": c.iteration, "episodes": c.episodes, **self.evals[key]})
            folder = self.dir / "eval" / key
            save_records(records, folder)
            if self.policy.is_vision and cfg.eval.gifs > 0:
                save_gifs(records, folder, limit=cfg.eval.gifs)

    def close(self) -> None:
        self.runner.close()
