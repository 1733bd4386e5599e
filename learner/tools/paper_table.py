"""The FreshPER paper's comparison at CPU scale: on-policy vs standard PER vs FreshPER vs uniform
replay, with equal environment-episode budgets, on the hub's tasks; and ablations on one task.

    python -m learner.tools paper-table --out runs/paper --seeds 0-4 --jobs 2             # the table
    python -m learner.tools paper-table --out runs/paper --seeds 0-4 --ablations          # + ablations
    python -m learner.tools paper-table --out runs/paper --report-only                    # rewrite the doc

Every (task, method, seed) is one ``train.py`` run (``learner/tools/sweep.py``: side by side on
``--jobs`` cores, a finished run is never rerun, an interrupted one resumes). Every method of a
task gets the same iterations of the same B x G tasks, so the same number of environment
episodes: the paper's axis, since interactions are the expensive part; replay methods spend
extra updates on stored trajectories. The report (``--doc``, default ``docs/results/paper.md``) has,
per task and method, the mean and 95% interval over seeds of the final and the best held-out
score, the late-training drop (final - best), curves against episodes and seconds, the IS
effective sample size per age bucket and the buffer's age histogram, and the commands. Every
number comes from a run folder's ``metrics.jsonl`` / ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from learner.report import kept_policy_row, read_metrics, seed_interval
from learner.tools.sweep import parse_seeds, run_sweep

REPO = Path(__file__).resolve().parents[2]  # the checkout: train.py and configs/


@dataclass
class Task:
    name: str
    config: str
    iterations: int
    extra: list[str] = field(default_factory=list)
    #: build the start once (the config's pretraining or warm-up, in ``<out>/<task>/start``) and
    #: start every run from its policy (``--model start/reference --pretrain-steps 0``): paired
    #: seeds share one start, and a given model's warm-up, which is not cached, is not repeated
    shared_start: bool = False
    #: FreshPER's tau for this task (the ``fresh`` arm)
    fresh_tau: float = 10.0
    #: ablations (keys of ``ABLATIONS``) run as arms of this task's table, ``fresh_<key>``
    arms: tuple[str, ...] = ()
    #: delete a finished run's weights (checkpoints, KL reference) as soon as it finishes: the
    #: table reads metrics and summaries only, and a real model's run folder holds ~2 GB of them
    prune: bool = False


#: FreshPER's tau on the real model: set from the drift its pilot measured (experiments/paper_real)
TAU_REAL = 4.0
TASKS = {
    "frozenlake": Task("FrozenLake 4x4, text", "configs/frozenlake_default.yaml", 400),
    "frozenlake_vision": Task("FrozenLake 4x4, image", "configs/frozenlake_vision.yaml", 150),
    "sokoban": Task("Sokoban simple", "configs/sokoban_simple.yaml", 100),
    # one pretrained start for every seed (its 2,400 steps at width 256 take ~25-50 minutes per
    # start): the seeds vary RL alone, so the intervals are RL's spread from that start
    "searchqa": Task("SearchQA (embedded KB)", "configs/searchqa.yaml", 60, ["--start-seed", "0"]),
    # a real pretrained chat model: one own-answer warm-up shared by every run, tau and the drift
    # knobs (lr, no KL penalty) from the pilot in experiments/paper_real/README.md
    "real_arithmetic": Task("Arithmetic, SmolLM2-135M-Instruct", "configs/paper_real_arithmetic.yaml", 16,
                            shared_start=True, fresh_tau=TAU_REAL, arms=("tauauto",), prune=True),
}
#: The paper's methods, replay as FreshPER's defaults here (one replay update per iteration, tau = 10
#: optimizer steps), on B x G trajectories per replay update (``--replay-batch none``, set below).
METHODS = {
    "none": ["--replay", "none"],
    "per": ["--replay", "per", "--replay-ratio", "1"],
    "fresh": ["--replay", "fresh", "--replay-ratio", "1", "--tau", "10"],
    "uniform": ["--replay", "uniform", "--replay-ratio", "1"],
}
#: Ablations of FreshPER on FrozenLake text (each varies one setting of "fresh").
ABLATIONS = {
    "tau2": ["--tau", "2"], "tau5": ["--tau", "5"], "tau40": ["--tau", "40"], "tau160": ["--tau", "160"],
    "tauauto": ["--tau", "auto"],
    "tauauto98": ["--tau", "auto", "--tau-target-ess", "0.98"],  # a stricter drift budget
    "tauautoclip": ["--tau", "auto", "--tau-signal", "clip"],  # steered by the clipped share (target 5%)
    "advantage": ["--priority", "advantage"],
    "k2": ["--replay-ratio", "2"],
    "classical": ["--is-weights", "classical"],
    "k2advantage": ["--replay-ratio", "2", "--priority", "advantage"],  # the two best settings together
}


def _fresh_with(flags: list[str]) -> list[str]:
    base = dict(zip(METHODS["fresh"][::2], METHODS["fresh"][1::2]))
    base.update(zip(flags[::2], flags[1::2]))
    return [x for kv in base.items() for x in kv]


def task_arms(ablations: bool, task: str) -> dict[str, list[str]]:
    spec = TASKS[task]
    arms = dict(METHODS)
    if spec.fresh_tau != 10.0:
        arms["fresh"] = _fresh_with(["--tau", f"{spec.fresh_tau:g}"])
    arms.update({f"fresh_{k}": _fresh_with(ABLATIONS[k]) for k in spec.arms})
    if ablations and task == "frozenlake":
        arms.update({f"fresh_{k}": _fresh_with(v) for k, v in ABLATIONS.items()})
    return arms


def start_flags(folder: Path) -> list[str]:
    """The flags that start a run from the task's shared start in ``folder/start``."""
    return ["--model", str(folder / "start" / "reference"), "--pretrain-steps", "0"]


def shared_start(folder: Path, common: list[str]) -> None:
    """Build the task's start once in ``folder/start``: one iteration of the config, its
    pretraining included; the KL reference it saves is the policy before RL."""
    start = folder / "start"
    if not (start / "summary.json").exists():
        import shutil
        import subprocess

        shutil.rmtree(start, ignore_errors=True)  # an interrupted build starts over
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(REPO / "train.py"), *common, "--iterations", "1", "--eval-every", "0",
               "--runs-root", str(folder), "--run-name", "start", "--seed", "0", "--no-progress"]
        print(f"building the shared start in {start}", flush=True)
        with (folder / "start.log").open("a", encoding="utf-8") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"building the shared start failed (exit {done.returncode}, see {folder / 'start.log'})")


def prune_weights(run: Path) -> None:
    """Delete a finished run's checkpoints and KL reference (its metrics, summary, evaluation
    episodes and config stay: all the table reads)."""
    import shutil

    if (run / "summary.json").exists():
        for name in ("checkpoints", "reference"):
            shutil.rmtree(run / name, ignore_errors=True)


# -- reading the runs -------------------------------------------------------------------------------
@dataclass
class RunResult:
    final: float
    best: float
    final_return: float
    evals: list[tuple[float, float, float]]  # (episodes, seconds of RL, held-out success) per evaluation
    ess: dict[str, float]
    age_mass: list[float] | None
    age_edges: list[float] | None
    tau_last: float | None
    updates: dict[str, float] = field(default_factory=dict)  # means over the replay iterations
    #: share of tokens outside the clip range per age bucket (the on-policy update's age 0 and the
    #: replay update's older ones), mean over the iterations that replayed
    clip: dict[str, float] = field(default_factory=dict)
    #: mean held-out success of the periodic evaluations (start of RL and final excluded): the
    #: area under the learning curve per evaluation, a sample-efficiency score over the whole run
    curve_mean: float = float("nan")


UPDATE_KEYS = {"grad_norm": "on-policy update: gradient norm", "replay_grad_norm": "replay update: gradient norm",
               "replay_weight_mean": "replay update: mean IS weight",
               "tokens": "on-policy update: reply tokens", "replay_tokens": "replay update: reply tokens",
               # a mean gradient norm can be set by a few outliers: its median, and how many the clip cut
               "replay_grad_norm_median": "replay update: median gradient norm",
               "replay_clipped": "replay updates above the clip",
               # how fast replayed data goes stale: the fitted ESS decay per optimizer step of age
               # (ESS = exp(-c age), what --tau auto steers by) and the replayed tokens outside the clip range
               "replay_drift_per_step": "replay: ESS decay per step of age", "replay_clip_frac": "replay: tokens outside the clip"}


def read_run(run: Path) -> RunResult | None:
    if not (run / "summary.json").exists():
        return None
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    rows = read_metrics(run / "metrics.jsonl")
    trains = [r for r in rows if r.get("kind") == "train"]
    seconds_at = {r["iteration"]: r.get("time_total_s", float("nan")) for r in trains}
    evals = [r for r in rows if r.get("kind") == "eval" and r.get("decoding") == "sampled" and not kept_policy_row(r)]
    curve = [(r["episodes"], seconds_at.get(r["iteration"], 0.0), r["success"]) for r in evals]
    final = summary["evals"]["final"]
    ess = _by_age(trains, ("ess/age_",))
    clip = _by_age(trains, ("clip_out/age_", "replay_clip_out/age_"))
    last = next((r for r in reversed(trains) if "buffer_age_mass" in r), None)
    replayed = [r for r in trains if r.get("buffer_size") and "replay_grad_norm" in r]
    updates = {k: float(np.mean([r[k] for r in replayed if k in r])) for k in UPDATE_KEYS
               if any(k in r for r in replayed)}
    if replayed:
        import yaml

        config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) if (run / "config.yaml").exists() else {}
        norms = np.array([r["replay_grad_norm"] for r in replayed])
        updates["replay_grad_norm_median"] = float(np.median(norms))
        updates["replay_clipped"] = float(np.mean(norms > float((config or {}).get("max_grad_norm", 1.0))))
    periodic = [r["success"] for r in evals if str(r.get("phase", "")).startswith("iter_")]
    return RunResult(final=final["success"], best=max(s for _, _, s in curve) if curve else final["success"],
                     curve_mean=float(np.mean(periodic)) if periodic else float("nan"),
                     final_return=final.get("return_mean", float("nan")), evals=curve, ess=ess, clip=clip,
                     age_mass=None if last is None else last["buffer_age_mass"],
                     age_edges=None if last is None else last.get("buffer_age_edges"),
                     tau_last=None if last is None else last.get("tau"), updates=updates)


def _by_age(trains: list[dict], prefixes: tuple[str, ...]) -> dict[str, float]:
    """A per-age-bucket measure (metrics keys ``<prefix><bucket>``) averaged over the iterations
    that replayed, by bucket."""
    out: dict[str, float] = {}
    for key in sorted({k for r in trains for k in r if k.startswith(prefixes)}):
        values = [r[key] for r in trains if key in r and r.get("buffer_size")]
        if values:
            out[key.split("/age_", 1)[1]] = float(np.mean(values))
    return out


def _mean_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% interval over seeds (one seed: the value itself as both ends)."""
    lo, hi = seed_interval(values) if len(values) > 1 else (values[0], values[0])
    return float(np.mean(values)), lo, hi


def _ci(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) < 2:
        return f"{values[0]:.3f}"
    mean, lo, hi = _mean_interval(values)
    return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def _paired(a: dict[int, RunResult], b: dict[int, RunResult], key: str = "final") -> list[float]:
    """Differences a - b of a score (``final``, ``curve_mean``) on the seeds both have."""
    return [getattr(a[s], key) - getattr(b[s], key) for s in a if s in b]


def _pair_cells(a: dict[int, RunResult], b: dict[int, RunResult]) -> str:
    """``| n | final a - b [95% CI] (k ahead) | curve mean a - b [95% CI] (k ahead) |``"""
    cells = []
    for key in ("final", "curve_mean"):
        d = [x for x in _paired(a, b, key) if math.isfinite(x)]
        cells.append(f"{_ci(d)} ({sum(x > 0 for x in d)} of {len(d)} ahead)" if d else "n/a")
    return f"| {sum(s in b for s in a)} | {cells[0]} | {cells[1]} |"


def pair_lines(label: str, pairs: list[tuple[str, dict[int, RunResult], dict[int, RunResult]]]) -> list[str]:
    """A table of paired differences (same seeds) of the final and the curve-mean scores."""
    rows = [f"| {name} " + _pair_cells(a, b) for name, a, b in pairs if set(a) & set(b)]
    if not rows:
        return []
    return [label, "", "| pair (A - B) | seeds | final: A - B | curve mean: A - B |", "|---|---|---|---|", *rows, ""]


def along_lines(by_seed: dict[str, dict[int, RunResult]], arms: list[str],
                sizes: tuple[int, int] = (200, 64)) -> list[str]:
    """Each replay arm against on-policy at every held-out evaluation of the run (paired on seeds,
    matched by environment episodes): where one method gets ahead, not only where it ends."""
    base = by_seed.get("none", {})
    others = [m for m in arms if m != "none" and set(by_seed.get(m, {})) & set(base)]
    if not others:
        return []

    # success by environment episodes, per arm and seed (the final evaluation wins a tie)
    at = {m: {s: {episodes: success for episodes, _, success in r.evals} for s, r in by_seed[m].items()}
          for m in ["none", *others]}
    points = sorted(set.intersection(*[set(curve) for seeds in at.values() for curve in seeds.values()]))
    if len(points) < 2:
        return []
    rows = []
    for episodes in points:
        cells = [f"{np.mean([curve[episodes] for curve in at['none'].values()]):.3f}"]
        for m in others:
            d = [curve[episodes] - at["none"][s][episodes] for s, curve in at[m].items() if s in base]
            cells.append(f"{np.mean([curve[episodes] for curve in at[m].values()]):.3f}")
            cells.append(f"{_ci(d)}, {sum(x > 0 for x in d)} of {len(d)} ahead")
        rows.append(f"| {episodes:,.0f} | " + " | ".join(cells) + " |")
    head = "| episodes | none | " + " | ".join(f"{m} | {m} - none" for m in others) + " |"
    return ["Along the way: held-out success at each evaluation (the start of RL, the periodic evaluations on "
            f"{sizes[1]} tasks, the final one on {sizes[0]}), and each replay arm minus on-policy on the same seeds:", "",
            head, "|---|" + "---|" * (1 + 2 * len(others)), *rows, ""]


def _plot(task: str, label: str, results: dict[str, list[RunResult]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, (method, runs) in enumerate(results.items()):
        runs = [r for r in runs if r.evals]
        if not runs:
            continue
        for col, ax in enumerate(axes):
            end = min(r.evals[-1][col] for r in runs)
            grid = np.linspace(0, end, 60)
            curves = [np.interp(grid, [e[col] for e in r.evals], [e[2] for e in r.evals]) for r in runs]
            mean = np.mean(curves, axis=0)
            ax.plot(grid, mean, color=f"C{k}", lw=2, label=f"{method} (mean of {len(runs)})")
            if len(runs) > 1:
                sem = np.std(curves, axis=0, ddof=1) / math.sqrt(len(runs))
                ax.fill_between(grid, mean - 1.96 * sem, mean + 1.96 * sem, color=f"C{k}", alpha=0.15)
    for ax, xlabel in zip(axes, ("environment episodes", "seconds of RL")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out success (sampled)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(label)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _tau_of(method: str) -> float | None:
    """The fixed tau an arm samples with: ``fresh`` 10, ``fresh_tauN`` N, ``per`` infinity; None
    for ``--tau auto``, the arms without age decay and the ablations of other settings."""
    if method == "per":
        return math.inf
    flags = METHODS["fresh"] if method == "fresh" else ABLATIONS.get(method.removeprefix("fresh_"), [])
    if not method.startswith("fresh") or "--tau" not in flags:
        return None
    try:
        return float(flags[flags.index("--tau") + 1])
    except ValueError:  # auto
        return None


def by_age_lines(label: str, replay: dict[str, list[RunResult]], field_name: str) -> list[str]:
    """A table of a per-age-bucket measure (``ess``, ``clip``) per arm, mean over its runs."""
    values = {m: [getattr(r, field_name) for r in runs] for m, runs in replay.items()}
    buckets = sorted({b for per_run in values.values() for v in per_run for b in v},
                     key=lambda b: float(b.split("-")[0].rstrip("+")))
    if not buckets:
        return []
    lines = [label, "", "| method | " + " | ".join(f"age {b}" for b in buckets) + " |", "|---|" + "---|" * len(buckets)]
    for method, per_run in values.items():
        cells = [f"{np.mean([v[b] for v in per_run if b in v]):.3f}" if any(b in v for v in per_run) else ""
                 for b in buckets]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def ablation_lines(by_seed: dict[str, dict[int, RunResult]]) -> list[str]:
    """A table of FreshPER's ablations, each paired on seeds against FreshPER itself."""
    fresh = by_seed.get("fresh", {})
    rows = []
    for key, flags in ABLATIONS.items():
        runs = by_seed.get(f"fresh_{key}", {})
        if not runs:
            continue
        paired = _paired(runs, fresh)
        rows.append(f"| `fresh_{key}` | `{shlex.join(flags)}` | {len(runs)} | {_ci([r.final for r in runs.values()])} "
                    f"| {_ci(paired) + f' (n={len(paired)})' if paired else ''} |")
    if not rows:
        return []
    return ["Ablations of FreshPER (`fresh`: " + shlex.join(METHODS["fresh"]) + "), each one setting changed, "
            "paired on seeds against `fresh` itself:", "",
            "| arm | changed | seeds | final | paired: final - fresh's, same seeds |", "|---|---|---|---|---|",
            *rows, ""]


def _plot_ablations(label: str, results: dict[str, list[RunResult]], out: Path) -> bool:
    """Final held-out success against tau (fixed values, PER as infinity, ``auto`` as a band),
    and of every other arm as a bar, each with its 95% interval over seeds."""
    taus = sorted((t, m) for m, runs in results.items() if runs and (t := _tau_of(m)) is not None)
    others = [m for m, runs in results.items() if runs and m != "fresh_tauauto" and (
        m in ("none", "fresh", "uniform") or (m.startswith("fresh_") and _tau_of(m) is None))]
    if len(taus) < 2:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def mean_ci(runs: list[RunResult]) -> tuple[float, float, float]:
        return _mean_interval([r.final for r in runs])

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    finite = [t for t, _ in taus if math.isfinite(t)]
    inf_at = (max(finite) * 4 if finite else 1.0)
    xs = [t if math.isfinite(t) else inf_at for t, _ in taus]
    stats = [mean_ci(results[m]) for _, m in taus]
    ax.errorbar(xs, [m for m, _, _ in stats], yerr=[[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]],
                fmt="o-", color="C0", capsize=4, label="fixed tau (infinity = standard PER)")
    if results.get("fresh_tauauto"):
        m, lo, hi = mean_ci(results["fresh_tauauto"])
        ax.axhspan(lo, hi, color="C1", alpha=0.15)
        ax.axhline(m, color="C1", lw=1.5, label="--tau auto (95% band)")
    if results.get("none"):
        ax.axhline(mean_ci(results["none"])[0], color="k", ls="--", lw=1, label="on-policy")
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{t:g}" if math.isfinite(t) else "inf\n(PER)" for t, _ in taus])
    ax.minorticks_off()
    ax.set_xlabel("tau (optimizer steps)")
    ax.set_ylabel("final held-out success")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if others:
        stats = [mean_ci(results[m]) for m in others]
        bx.bar(range(len(others)), [m for m, _, _ in stats], color=[f"C{k + 2}" for k in range(len(others))],
               yerr=[[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]], capsize=4)
        bx.set_xticks(range(len(others)), others, rotation=30, ha="right", fontsize=8)
        bx.set_ylabel("final held-out success")
        bx.grid(alpha=0.3, axis="y")
    else:
        bx.axis("off")
    fig.suptitle(f"{label}: FreshPER's settings (mean and 95% interval over seeds)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


NOTES_START, NOTES_END = "<!-- notes: kept when the report is rewritten -->", "<!-- end of notes -->"


def kept_notes(doc: Path) -> str:
    """The hand-written reading of the table in an existing report (between the notes markers),
    carried into the rewritten one; an empty block to write into otherwise."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else ""
    if NOTES_START in text and NOTES_END in text.split(NOTES_START, 1)[1]:
        return NOTES_START + text.split(NOTES_START, 1)[1].split(NOTES_END, 1)[0] + NOTES_END
    return f"{NOTES_START}\n{NOTES_END}"


TITLE = "Results: on-policy vs PER vs FreshPER vs uniform replay at CPU scale"


def write_report(out: Path, doc: Path, tasks: list[str], seeds: list[int], ablations: bool, commands: list[str],
                 against: Path | None = None, title: str = TITLE) -> str:
    """Write the results document from the run folders; return its text. ``against``: another
    folder of runs of the same arms (e.g. one setting changed for all) to pair each arm with."""
    img_dir = doc.parent / "img"
    img_dir.mkdir(parents=True, exist_ok=True)
    sizes = eval_sizes(out, tasks)
    lines = [f"# {title}", "",
             "Written by `python -m learner.tools paper-table` from the run folders under "
             f"`{out}` (each number is the mean over seeds of a run's `summary.json` / `metrics.jsonl`, with "
             "a 95% t-interval over seeds). Held-out success is sampled at temperature 1 on the same held-out tasks "
             f"for every run: final = the last iteration's evaluation ({sizes[0]} test tasks), best = the best of the periodic "
             + (f"evaluations ({sizes[1]} tasks each: the first {sizes[1]} test tasks in runs made before the periodic evaluations moved "
                "to validation tasks, validation tasks since)" if sizes == (200, 64) else
                f"evaluations ({sizes[1]} validation tasks each)")
             + " and the final one (so it is biased upwards by evaluation noise), "
             "drop = final - best, curve mean = the mean of the periodic evaluations (the area under the learning "
             "curve per evaluation: how early a method gets there, not only where it ends). Every method of a "
             "task has the same environment-episode budget.", ""]
    header = ("| task | method | seeds | final | best | final - best | curve mean | vs on-policy (final, same seeds) "
              "| paired: final - on-policy's, same seeds |")
    lines += [header, "|---|---|---|---|---|---|---|---|---|"]
    details: list[str] = []
    for task in tasks:
        spec = TASKS[task]
        results = {}
        by_seed: dict[str, dict[int, RunResult]] = {}
        for method in task_arms(ablations, task):
            runs = {s: read_run(out / task / f"{method}_s{s}") for s in seeds}
            by_seed[method] = {s: r for s, r in runs.items() if r is not None}
            results[method] = list(by_seed[method].values())
        on_policy = by_seed.get("none", {})
        for method, runs in results.items():
            if not runs:
                continue
            finals, bests = [r.final for r in runs], [r.best for r in runs]
            paired = _paired(by_seed[method], on_policy) if method != "none" else []
            # relative to on-policy on the same seeds (an arm with fewer seeds is not set against other starts)
            base = np.mean([on_policy[s].final for s in by_seed[method] if s in on_policy]) if paired else float("nan")
            rel = np.mean(paired) / base * 100 if paired and base > 0 else float("nan")
            paired_text = f"{_ci(paired)} (n={len(paired)})" if paired else ""
            lines.append(f"| {spec.name} | {method} | {len(runs)} | {_ci(finals)} | {_ci(bests)} | "
                         f"{np.mean(np.subtract(finals, bests)):+.3f} | {_ci([r.curve_mean for r in runs])} | {f'{rel:+.0f}%' if math.isfinite(rel) and method != 'none' else ''} "
                         f"| {paired_text} |")
        png = img_dir / f"{doc.stem}_{task}.png"  # paper.md: img/paper_<task>.png
        _plot(task, spec.name, {m: r for m, r in results.items() if not m.startswith("fresh_")}, png)
        details += [f"## {spec.name}", "", f"![held-out success, {spec.name}]({png.relative_to(doc.parent)})", ""]
        main_arms = [m for m in ("fresh", *(f"fresh_{k}" for k in spec.arms), "per", "uniform", "none")
                     if by_seed.get(m)]  # A before B
        details += pair_lines("Paired differences between the methods (same seeds; final and curve mean as in the "
                              "table):", [(f"{a} - {b}", by_seed[a], by_seed[b]) for i, a in enumerate(main_arms)
                                          for b in main_arms[i + 1:]])
        details += along_lines(by_seed, [m for m in METHODS if by_seed.get(m)], sizes)
        if against is not None:
            other = {m: {s: r for s in seeds if (r := read_run(against / task / f"{m}_s{s}")) is not None}
                     for m in by_seed}
            details += pair_lines(f"Each arm against the same arm's runs in `{against}` (same seeds):",
                                  [(f"{m} - {m} there", by_seed[m], other[m]) for m in by_seed if other.get(m)])
        if ablations:
            details += ablation_lines(by_seed)
            abl_png = img_dir / f"{doc.stem}_{task}_ablations.png"
            if _plot_ablations(spec.name, results, abl_png):
                details += [f"![FreshPER's settings, {spec.name}]({abl_png.relative_to(doc.parent)})", ""]
        replay = {m: r for m, r in results.items() if r and r[0].ess}
        if replay:
            details += by_age_lines("IS effective sample size per token (normalised, mean over training) by age in "
                                    "optimizer steps:", replay, "ess")
            details += by_age_lines("Share of tokens outside the clip range `|w - 1| > eps` (mean over training) by "
                                    "age in optimizer steps (age 0: the on-policy update's):", replay, "clip")
            keys = [k for k in UPDATE_KEYS if any(k in r.updates for runs in replay.values() for r in runs)]
            if keys:
                details += ["The updates of an iteration (means over training and seeds; gradient norms before "
                            "clipping at `--max-grad-norm`):", "",
                            "| method | " + " | ".join(UPDATE_KEYS[k] for k in keys) + " |",
                            "|---|" + "---|" * len(keys)]
                for method, runs in replay.items():
                    cells = [f"{np.mean([r.updates[k] for r in runs if k in r.updates]):.{0 if 'tokens' in k else 3}f}"
                             if any(k in r.updates for r in runs) else "" for k in keys]
                    details.append(f"| {method} | " + " | ".join(cells) + " |")
                details.append("")
            details += ["Sampling mass by item age at the end of training (buffer age histogram, mean over seeds):", ""]
            for method, runs in replay.items():
                masses = [r.age_mass for r in runs if r.age_mass]
                if masses:
                    mass = np.mean(masses, axis=0)
                    edges = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
                    cells = ", ".join(f"<{edges[i + 1]}: {m:.2f}" if i + 1 < len(edges) else f">={edges[i]}: {m:.2f}"
                                      for i, m in enumerate(mass) if m > 0.005)
                    taus = [r.tau_last for r in runs if r.tau_last is not None]
                    tau_note = f" (tau at the end: {np.mean(taus):.1f})" if "auto" in method and taus else ""
                    details.append(f"- {method}: {cells}{tau_note}")
            details.append("")
    lines += ["", kept_notes(doc), "", *details, "## Commands", "", "```", *commands, "```", ""]
    text = "\n".join(lines)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text, encoding="utf-8")
    return text


def eval_sizes(out: Path, tasks: list[str]) -> tuple[int, int]:
    """The final and the periodic evaluations' task counts of the runs in the report (their
    ``config.yaml``); the tiny default's recipes' (200, 64) where no run says otherwise."""
    import yaml

    found = set()
    for task in tasks:
        for config in sorted((out / task).glob("*_s*/config.yaml"))[:1]:
            cfg = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
            found.add((int(cfg.get("final_eval_episodes", 200)), int(cfg.get("eval_episodes", 64))))
    return found.pop() if len(found) == 1 else (200, 64)


def recorded_iterations(folder: Path) -> int | None:
    """The iteration budget the finished runs in ``folder`` share (their ``config.yaml``), or
    None when there are none or they differ."""
    import yaml

    budgets = {yaml.safe_load(config.read_text(encoding="utf-8")).get("iterations")
               for config in folder.glob("*/config.yaml") if (config.parent / "summary.json").exists()}
    return budgets.pop() if len(budgets) == 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/paper", help="folder of the run folders (one subfolder per task)")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--methods", nargs="*", default=None, help="a subset of the arms (default: all)")
    parser.add_argument("--seeds", default="0-4")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--ablations", action="store_true", help="also the FreshPER ablations on FrozenLake text")
    parser.add_argument("--iterations", type=int, default=None, help="override every task's budget (tests, quick looks)")
    parser.add_argument("--doc", default="docs/results/paper.md")
    parser.add_argument("--title", default=TITLE, help="the report's title (one per results page)")
    parser.add_argument("--against", type=Path, default=None,
                        help="another --out folder of the same arms: pair each arm with its runs there")
    parser.add_argument("--report-only", action="store_true", help="do not run anything; rewrite the report")
    parser.add_argument("extra", nargs="*", help="after --: flags passed to every train.py run")
    args = parser.parse_args(argv)
    out, seeds = Path(args.out), parse_seeds(args.seeds)
    commands = [f"python -m learner.tools paper-table {shlex.join(argv if argv is not None else sys.argv[1:])}"]
    failed: list[str] = []
    for task in args.tasks:
        spec = TASKS[task]
        arms = task_arms(args.ablations, task)
        if args.methods:
            arms = {k: v for k, v in arms.items() if k in args.methods}
        # replay arms replay B x G trajectories per update, the table's setting since it was first run
        # (train.py's default replay batch is 16); flags given after `--` still win
        iterations = args.iterations or spec.iterations
        if args.report_only:  # the report's command says what its runs ran
            iterations = recorded_iterations(out / task) or iterations
        common = ["--config", str(REPO / spec.config), "--iterations", str(iterations),
                  *spec.extra, "--replay-batch", "none", *args.extra]
        start = start_flags(out / task) if spec.shared_start else []
        if spec.shared_start:
            commands.append(f"# {spec.name}, the shared start: python train.py --config {spec.config} "
                            f"{shlex.join(spec.extra + args.extra)} --iterations 1 --eval-every 0 "
                            f"--runs-root {out / task} --run-name start --seed 0")
        shown = ["--config", str(spec.config), *common[2:], *start]  # the checkout-relative path a reader types
        commands.append(f"# {spec.name}: python train.py {shlex.join(shown)} --seed <k> <method flags>")
        for arm, flags in arms.items():
            commands.append(f"#   {arm}: {shlex.join(flags)}")
        if not args.report_only:
            print(f"== {spec.name}: {len(arms)} settings x {len(seeds)} seeds", flush=True)
            if spec.shared_start:
                shared_start(out / task, ["--config", str(REPO / spec.config), *spec.extra, *args.extra])
            failed += run_sweep(out / task, arms, seeds, common + start, args.jobs,
                                on_finish=prune_weights if spec.prune else None)
    text = write_report(out, Path(args.doc), args.tasks, seeds, args.ablations, commands, args.against, args.title)
    print(text.split("\n## ")[0])
    if failed:
        print(f"failed runs: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
