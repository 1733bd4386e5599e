"""Run reporting: metrics.jsonl + TensorBoard, ``curves.png``, confidence intervals, the final
summary table, and the FrozenLake board-reading probe.

Metrics are one JSON object per line with ``kind`` = ``"train"`` (one per iteration),
``"eval"`` (one per evaluation) or ``"warmup"``; every line carries ``iteration`` and
``episodes`` (environment episodes collected for training so far), the x axis of the curves.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from agents.evaluate import wilson_interval
from agents.runfolder import read_metrics
from agents.safeio import open_nofollow

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Appends metric lines to ``metrics.jsonl`` and mirrors numbers to the experiment trackers
    (``report_to``: :func:`learner.trackers.parse_report_to`'s names; default TensorBoard, or
    none with ``tensorboard=False``).

    On resume, lines past the checkpoint's iteration (written after the checkpoint by the run
    that was killed) are dropped so the file reads as if the run had never stopped.
    """

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, resume_iteration: int | None = None,
                 report_to: list[str] | None = None) -> None:
        from learner.trackers import open_trackers, parse_report_to

        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_iteration is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path)
                    if r.get("iteration", 0) <= resume_iteration and not str(r.get("phase", "")).startswith("final")]
            tmp = self.path.with_suffix(".tmp")
            with open_nofollow(tmp, "w") as fh:
                fh.write("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        elif resume_iteration is None and self.path.exists():
            self.path.unlink()
        self._fh = open_nofollow(self.path, "a")  # a planted link is refused, not written through
        names = report_to if report_to is not None else parse_report_to(None, tensorboard)
        try:
            self.trackers = open_trackers(run_dir, names)
        except BaseException:
            self._fh.close()
            raise

    def log(self, record: dict[str, Any]) -> None:
        """Write one line; numeric entries also go to the trackers as ``<kind>/<name>``."""
        self._fh.write(json.dumps(record, default=float) + "\n")
        self._fh.flush()
        if self.trackers:
            step = int(record.get("episodes", record.get("iteration", 0)))
            kind = record.get("kind", "train")
            self.report({f"{kind}/{key}": value for key, value in record.items()
                         if isinstance(value, (int, float)) and not isinstance(value, bool)
                         and key not in ("iteration", "episodes")}, step)

    def report(self, scalars: dict[str, float], step: int, histograms: dict[str, Any] | None = None) -> None:
        """Send numbers (and histograms of values) to the trackers only, at ``step`` (training
        episodes): the replay log's figures."""
        for tracker in self.trackers:
            tracker.log(scalars, int(step))
            for key, values in (histograms or {}).items():
                tracker.histogram(key, values, int(step))

    def close(self) -> None:
        self._fh.close()
        for tracker in self.trackers:
            tracker.close()


def intervals_disjoint(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two confidence intervals do not overlap."""
    return a[1] < b[0] or b[1] < a[0]


# -- the task's own probe ---------------------------------------------------------------------
def task_turn_diagnostics(env_id: str, records: Iterable[Any], env_kwargs: dict[str, Any] | None = None) -> dict[str, float]:
    """The task's probe over the turns of (evaluation) records: its ``turn_diagnostics``
    (:class:`envs.capabilities.TurnDiagnostics`; FrozenLake: the safe-move rate where exactly
    one of Down/Right is a hole, 0.5 = board-blind); empty for tasks without one.

    An image task's observation text does not show the state, so for a vision task each episode
    is replayed on the task (``env_kwargs``, the record's task seed and replies) and the probe
    reads ``render_text()`` of every turn's state instead (:func:`replayed_state_turns`). Where
    a replay does not reproduce its record (a task that is not deterministic given its seed),
    there is no probe: ``{}``."""
    import envs
    from envs.capabilities import turn_diagnostics

    cls = envs.task_class(env_id)
    if cls.modality == "vision":
        try:
            turns = replayed_state_turns(env_id, env_kwargs or {}, records)
        except ValueError:
            return {}
    else:
        turns = [(t.observation, t.reply) for rec in records for t in rec.turns]
    return turn_diagnostics(cls, turns)


def replayed_state_turns(env_id: str, env_kwargs: dict[str, Any], records: Iterable[Any]) -> list[tuple[str, str]]:
    """(state text, reply) of every turn of ``records``, rebuilt by resetting the task on each
    record's task seed and stepping it with the record's replies; ``render_text()`` gives each
    turn's state in the task's text notation. Raises ``ValueError`` when a replayed episode does
    not end with its record's return (the records come from another task or other settings)."""
    import envs

    env = envs.make(env_id, **env_kwargs)
    turns: list[tuple[str, str]] = []
    try:
        for rec in records:
            env.reset(seed=int(rec.seed))
            total = 0.0
            for turn in rec.turns:
                turns.append((env.unwrapped.render_text(), turn.reply))
                _, reward, terminated, truncated, _ = env.step(turn.reply)
                total += float(reward)
                if terminated or truncated:
                    break
            if abs(total - float(rec.episode_return)) > 1e-6:
                raise ValueError(f"episode of task seed {rec.seed}: {env_id} with {env_kwargs} returns {total} for "
                                 f"its replies, the record {rec.episode_return}: not the task these records come from")
    finally:
        env.close()
    return turns


# -- curves.png -------------------------------------------------------------------------------
def kept_policy_row(row: dict[str, Any]) -> bool:
    """An evaluation of the policy ``--select best`` kept (phases ``selected``/``selected_*``):
    an earlier iteration's policy, scored at the end, so not a point of the training curve."""
    return str(row.get("phase", "")).startswith("selected")


def plot_curves(metrics_path: str | os.PathLike, out_path: str | os.PathLike, title: str = "") -> Path:
    """Return, success, IS ESS and ratio statistics against environment episodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval" and not kept_policy_row(r)]
    kept = [r for r in rows if r.get("kind") == "eval" and r.get("phase") == "selected"]
    x = [r["episodes"] for r in train]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0, 0]
    ax.plot(x, [r.get("return_mean", float("nan")) for r in train], label="train return (mean)")
    ax.set_title("episode return")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    ax.plot(x, [r.get("success", float("nan")) for r in train], alpha=0.6, label="train success (sampled)")
    episodes_at = {r["iteration"]: r["episodes"] for r in train}
    for k, decoding in enumerate(sorted({r.get("decoding", "") for r in evals}, reverse=True)):
        pts = [r for r in evals if r.get("decoding", "") == decoding]
        lo = [r["success"] - r.get("success_ci_low", r["success"]) for r in pts]
        hi = [r.get("success_ci_high", r["success"]) - r["success"] for r in pts]
        ax.errorbar([r["episodes"] for r in pts], [r["success"] for r in pts], yerr=[lo, hi], fmt="o-" if k == 0 else "s--",
                    capsize=3, color=("C3", "C2", "C4")[k % 3], label=f"eval, {decoding or 'eval'} (95% CI)")
    for r in kept:  # the delivered policy (--select best), scored on the test tasks at the end
        at = episodes_at.get(r.get("policy_iteration"), r["episodes"])
        ax.plot([at], [r["success"]], "*", ms=14, color="C1", label="kept policy, sampled, test tasks")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("success rate (periodic evals: validation tasks; start, end: test tasks)", fontsize=10)
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    keys = sorted({k for r in train for k in r if k.startswith("ess")})
    for k in keys:
        pts = [(r["episodes"], r[k]) for r in train if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", label=k, alpha=0.8)
    ax.set_ylim(-0.02, 1.05)
    ax.set_title("IS effective sample size / n, by age (age 0: on-policy, 1)")
    if keys:
        ax.legend(fontsize=7)
    ax = axes[1, 1]
    for k in ("ratio_mean", "ratio_max", "ratio_min", "clip_frac"):
        pts = [(r["episodes"], r[k]) for r in train if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=k, alpha=0.8)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_title("token ratio vs behaviour policy (all updates)")
    ax.legend(fontsize=8)
    for a in axes.flat:
        a.set_xlabel("environment episodes")
        a.grid(alpha=0.3)
    top = 1.0
    if title:  # wrapped to the figure's width, with room kept above the panels for every line
        import textwrap

        lines = [part for line in title.splitlines() for part in textwrap.wrap(line, 140) or [""]]
        fig.suptitle("\n".join(lines), fontsize=10)
        top = 1.0 - 0.022 * len(lines)
    fig.tight_layout(rect=(0, 0, 1, top))
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with aligned columns."""
    cells = [[str(h) for h in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


#: FrozenLake 4x4 policies that read nothing (docs/design.md): random Down/Right, the best fixed path.
BLIND_DOWN_RIGHT, BLIND_BEST_PATH = 0.39, 0.46


def board_reading_verdict(final: dict[str, Any]) -> tuple[bool | None, str]:
    """Whether an improvement is more than the board-blind Down/Right habit (None, '' when no probe ran;
    tasks without the safe-move probe get :func:`counterfactual_verdict`).

    A policy reads the board if its success clearly beats the best fixed path (CI above 0.46)
    or, on states where exactly one of Down/Right leads into a hole, it picks the safe one more
    often than chance (the probe's 95% CI above 0.5).
    """
    n = int(final.get("probe_down_right", 0) or 0)
    if not n or math.isnan(final.get("probe_safe_rate", float("nan"))):
        return counterfactual_verdict(final)
    rate = final["probe_safe_rate"]
    lo, hi = wilson_interval(round(rate * n), n)
    beats_path = final["success_ci_low"] > BLIND_BEST_PATH
    reads = beats_path or lo > 0.5
    return reads, (f"board reading: safe-move probe {rate:.2f} [{lo:.2f}, {hi:.2f}] (0.5 = blind), success CI "
            f"{'above' if beats_path else 'not above'} the best fixed path {BLIND_BEST_PATH} "
            f"(random Down/Right {BLIND_DOWN_RIGHT}) - "
            + ("reads the board" if reads else "no evidence beyond the board-blind Down/Right habit"))


def picture_verdict(final: dict[str, Any]) -> tuple[bool | None, str]:
    """Whether a figure task's policy reads its picture (None, '' where the evaluation did not
    play the task with another problem's picture): its success with each episode's own picture
    is above its success with another problem's, the 95% intervals apart."""
    other = final.get("other_picture_success")
    if other is None:
        return None, ""
    lo, hi = final["other_picture_ci_low"], final["other_picture_ci_high"]
    reads = bool(final["success"] > other and final["success_ci_low"] > hi)
    return reads, (f"picture reading: success {final['success']:.2f} [{final['success_ci_low']:.2f}, "
                   f"{final['success_ci_high']:.2f}] with each task's own picture, {other:.2f} [{lo:.2f}, {hi:.2f}] "
                   "with another problem's - " + ("reads the picture" if reads
                                                  else "no evidence that it reads the picture"))


def counterfactual_verdict(final: dict[str, Any]) -> tuple[bool | None, str]:
    """The board-reading verdict of a task without a safe-move probe (None, '' without
    counterfactual probes): on pairs of states that differ in one detail next to the player,
    the policy reads the board if it takes the move that detail favours more often, the mean
    shift's 95% interval above 0."""
    lo, hi = final.get("counterfactual_ci_low"), final.get("counterfactual_ci_high")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return None, ""
    reads = bool(lo > 0)
    n = int(final.get("counterfactual_pairs", 0) or 0)
    return reads, (f"board reading: counterfactual shift {final['counterfactual_shift']:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                   f"over {n} board pairs that differ next to the player (0 = blind) - "
                   + ("reads the board" if reads else "no evidence that the move depends on the cells next to the player"))


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _task_probe(e: dict[str, Any]) -> str:
    """The evaluation's task probe for the summary table: a figure task's success with another
    problem's picture, FrozenLake's safe-move rate, or the share of moves that changed nothing
    (Sokoban)."""
    safe, noop = e.get("probe_safe_rate", float("nan")), e.get("noop_rate", float("nan"))
    if "other_picture_success" in e:
        return f"other picture {e['other_picture_success']:.2f}"
    if not math.isnan(safe):
        return f"safe {safe:.2f} (n={int(e['probe_down_right'])})"
    return f"no-op {noop:.2f}" if not math.isnan(noop) else "n/a"


def summarize(evals: dict[str, dict[str, Any]], state: dict[str, Any], wall: float) -> dict[str, Any]:
    """The final table: success with 95% CIs at the start of RL and at the end, the task's probe
    and the policy diagnostics, and the verdicts (improvement; board reading where a probe ran)."""
    names = {"baseline": "start of RL", "final": "final (last iteration)", "selected": "selected (best validation)"}
    rows = []
    for key in sorted(evals, key=lambda k: (list(names).index(k.split("_")[0]), k)):
        e = evals[key]
        label = names[key.split("_")[0]] + f", {e.get('decoding', '')}"
        rows.append([label, int(e["episodes_eval"]), f"{e['success']:.3f}",
                     f"[{e['success_ci_low']:.3f}, {e['success_ci_high']:.3f}]", f"{e['return_mean']:.3f}",
                     f"{e['invalid_rate']:.3f}", _task_probe(e),
                     _fmt(e.get("action_spread")), _fmt(e.get("counterfactual_shift"), "+.2f")])
    table = format_table(["evaluation", "episodes", "success", "95% CI", "return", "invalid", "task probe",
                          "action spread", "counterfactual"], rows)
    # The verdicts are the delivered policy's: the selected one where a run kept another than its last.
    base, final = evals.get("baseline"), evals.get("selected", evals["final"])
    verdict = "no baseline evaluation"
    learned = False
    if base is not None:
        a = (base["success_ci_low"], base["success_ci_high"])
        b = (final["success_ci_low"], final["success_ci_high"])
        learned = final["success"] > base["success"] and intervals_disjoint(a, b)
        which = "selected" if "selected" in evals else "final"
        verdict = (f"{final.get('decoding', '')} success: {which} {final['success']:.2f} vs start of RL {base['success']:.2f}: 95% CIs "
                   f"{'do not overlap - improved' if learned else 'overlap or final is lower - no clear improvement'}")
    reads_board, board_text = board_reading_verdict(final)
    if reads_board is None:
        reads_board, board_text = picture_verdict(final)
    if board_text:
        verdict += f"\n{board_text}"
    text = (f"\n{table}\n\n{verdict}\n{state['iteration']} iterations, "
            f"{state['episodes']} training episodes, {state['nonfinite_total']} skipped updates, "
            f"{state.get('rl_seconds', 0.0):.0f} s of RL iterations in all (resumed sessions included), "
            f"wall time of this session {wall:.0f} s (its set-up and the start model's pretraining included)\n"
            "action spread: mean total-variation distance between the policy's action distributions on different "
            "states (0 = the same everywhere); counterfactual: how much more the policy takes the move a changed "
            "detail favours (0 = blind to it)"
            + ("; other picture: success on the same tasks with each picture another problem's"
               if any("other_picture_success" in e for e in evals.values()) else ""))
    return {"evals": evals, "learned": learned, "reads_board": reads_board, "verdict": verdict, "text": text, "wall_seconds": wall,
            "rl_seconds": float(state.get("rl_seconds", 0.0)), "iterations": state["iteration"], "episodes": state["episodes"]}


# -- comparing runs ---------------------------------------------------------------------------
def _finite_mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def seed_interval(values: Sequence[float], z: float | None = None) -> tuple[float, float]:
    """95% interval of the mean over seeds (Student t; one value: the value itself)."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return float("nan"), float("nan")
    if v.size == 1:
        return float(v[0]), float(v[0])
    t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(v.size, 1.96)
    half = (z or t) * v.std(ddof=1) / math.sqrt(v.size)
    return float(v.mean() - half), float(v.mean() + half)


def compare_runs(groups: dict[str, list[str | os.PathLike]], out_path: str | os.PathLike | None = None,
                 window: int = 20) -> str:
    """Side by side: per labelled group of run folders (e.g. seeds of one setting), the final
    held-out success and probe of every run and their mean, as a table (with the delivered policy's
    success: the one ``--select best`` kept, else the last); with ``out_path`` also a
    plot of training success (moving mean over ``window`` iterations) against environment
    episodes and against seconds of RL, one thin line per run and a thick one per group mean."""
    table_rows, curves = [], {}
    for label, dirs in groups.items():
        finals, probes, greedys, shifts, delivered, per_run = [], [], [], [], [], []
        for d in dirs:
            d = Path(d)
            summary = json.loads((d / "summary.json").read_text(encoding="utf-8"))
            final = summary["evals"].get("final", {})
            finals.append(final.get("success", float("nan")))
            probes.append(final.get("probe_safe_rate", float("nan")))
            greedy = summary["evals"].get("final_greedy", {}).get("success", float("nan"))
            greedys.append(greedy)
            shifts.append(final.get("counterfactual_shift", float("nan")))
            kept = summary["evals"].get("selected", final)
            delivered.append(kept.get("success", float("nan")))
            table_rows.append([label, d.name, summary["iterations"], summary["episodes"], f"{finals[-1]:.3f}",
                               f"[{final.get('success_ci_low', float('nan')):.3f}, {final.get('success_ci_high', float('nan')):.3f}]",
                               _fmt(greedy, ".3f"), f"{probes[-1]:.2f}", _fmt(shifts[-1], "+.2f"),
                               f"{delivered[-1]:.3f} (it. {summary.get('selected_iteration', summary['iterations'])})"])
            train = [r for r in read_metrics(d / "metrics.jsonl") if r.get("kind") == "train"]
            success = np.array([r.get("success", np.nan) for r in train], dtype=float)
            smooth = np.array([_finite_mean(success[max(0, i - window + 1): i + 1]) for i in range(len(success))])
            per_run.append((np.array([r["episodes"] for r in train], dtype=float),
                            np.array([r.get("time_total_s", np.nan) for r in train], dtype=float), smooth))
        lo, hi = seed_interval(finals)
        table_rows.append([label, "mean", "", "", f"{_finite_mean(finals):.3f}", f"[{lo:.3f}, {hi:.3f}] over seeds",
                           _fmt(_finite_mean(greedys), ".3f"), f"{_finite_mean(probes):.2f}", _fmt(_finite_mean(shifts), "+.2f"),
                           f"{_finite_mean(delivered):.3f}"])
        curves[label] = per_run
    text = format_table(["setting", "run", "iterations", "episodes", "final success", "95% CI", "greedy", "probe",
                         "counterfactual", "delivered"], table_rows)
    if out_path is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for k, (label, per_run) in enumerate(curves.items()):
            color = f"C{k}"
            for col, ax in ((0, axes[0]), (1, axes[1])):
                for run in per_run:
                    ax.plot(run[col], run[2], color=color, alpha=0.25, lw=0.8)
                if per_run:  # the group mean on a common grid, up to where every run has data
                    end = min(run[col][-1] for run in per_run)
                    grid = np.linspace(0, end, 200)
                    mean = np.mean([np.interp(grid, run[col], run[2]) for run in per_run], axis=0)
                    ax.plot(grid, mean, color=color, lw=2.2, label=f"{label} (mean of {len(per_run)})")
        for ax, xlabel in zip(axes, ("environment episodes", "seconds of RL")):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"training success (mean of last {window} iterations)")
            ax.set_ylim(-0.02, 1.0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_path, dpi=110)
        plt.close(fig)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m learner.report", description="Compare training runs side by side.")
    parser.add_argument("groups", nargs="+", metavar="LABEL=RUN[,RUN...]",
                        help="a label and its run folders, e.g. none=runs/a,runs/b fresh=runs/c,runs/d")
    parser.add_argument("--out", default=None, help="write the comparison plot here (PNG)")
    parser.add_argument("--window", type=int, default=20, help="moving-mean window of the training curves, in iterations")
    args = parser.parse_args(argv)
    groups: dict[str, list[str]] = {}
    for item in args.groups:
        label, sep, runs = item.partition("=")
        if not sep or not runs:
            parser.error(f"expected LABEL=RUN[,RUN...], got {item!r}")
        groups[label] = runs.split(",")
    try:
        print(compare_runs(groups, args.out, args.window))
    except FileNotFoundError as exc:
        print(f"error: {exc} (is it a finished run folder with summary.json?)")
        return 2
    if args.out:
        print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
