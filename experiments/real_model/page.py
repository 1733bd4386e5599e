"""The tables and curves of docs/results/real_model.md, from archived runs.

    .venv/bin/python experiments/real_model/page.py docs/data/real_model/* \
        --tiny docs/data/default200/it200_s0 --plot docs/results/img/real_model_curves.png

Per run: the task, held-out success at the start of RL (after the warm-up) and of the
delivered policy with 95% Wilson intervals, whether they are disjoint, invalid replies at both,
the warm-up's usable share (own answers) and its seconds, RL iterations and wall seconds. Then
the policy's drift under the update rule, per run and for the tiny default (``--tiny``): the
median over iterations of the KL to the reference, the replay updates' drift per optimizer step
and clip fraction, and the IS effective sample size of replayed tokens by age.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from learner.report import intervals_disjoint, read_metrics


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _med(rows: list[dict], key: str) -> str:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return f"{statistics.median(vals):.3f}" if vals else "-"


def _by_operation(path: Path) -> dict[str, list[int]]:
    """Successes and episodes of an Arithmetic evaluation's archived records by operation
    (subtraction split by the answer's sign); {} where the records are not there."""
    import gzip
    import re

    if not path.is_file():
        return {}
    out: dict[str, list[int]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            m = re.search(r"Calculate (\d+) ([-+*]) (\d+)", r["turns"][0]["observation"])
            if m is None:
                return {}
            a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
            key = ("-, answer < 0" if a < b else "-, answer >= 0") if op == "-" else op
            cell = out.setdefault(key, [0, 0])
            cell[0] += bool(r.get("success"))
            cell[1] += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--tiny", type=Path, default=None, help="a tiny-default run to set the drift beside")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    print("| run | task | start of RL | delivered | disjoint | invalid start -> delivered | warm-up | RL iterations | RL s |")
    print("|---|---|---|---|---|---|---|---:|---:|")
    curves = {}
    for run in args.runs:
        rows = read_metrics(run / "metrics.jsonl")
        ev = _summary(run)["evals"]
        start, final = ev["baseline"], ev.get("selected") or ev.get("final")
        pre = next((r for r in rows if r.get("kind") == "pretrain"), {})
        train = [r for r in rows if r.get("kind") == "train"]
        task = next((r for r in rows if r.get("kind") == "eval"), {}).get("env_id") or run.name
        cfg = (run / "config.yaml").read_text()
        env_id = next((line.split(":", 1)[1].strip() for line in cfg.splitlines() if line.startswith("env_id:")), "?")
        a = (start["success_ci_low"], start["success_ci_high"])
        b = (final["success_ci_low"], final["success_ci_high"])
        warm = (f"own answers, {pre['pretrain_own_usable']:.0%} usable" if "pretrain_own_usable" in pre
                else "random replies") + f", {pre.get('pretrain_steps', 0)} steps, {pre.get('pretrain_seconds', 0):.0f} s"
        print(f"| {run.name} | {env_id} | {start['success']:.3f} [{a[0]:.3f}, {a[1]:.3f}] | {final['success']:.3f} "
              f"[{b[0]:.3f}, {b[1]:.3f}] | {'yes' if intervals_disjoint(a, b) and final['success'] > start['success'] else 'no'} | "
              f"{start['invalid_rate']:.3f} -> {final['invalid_rate']:.3f} | {warm} | {len(train)} | "
              f"{train[-1]['time_total_s'] if train else 0:.0f} |")
        curves[f"{run.name} ({env_id.split('/')[-1]})"] = (
            [r["iteration"] for r in train], [r["success"] for r in train],
            [(r["iteration"], r["success"]) for r in rows if r.get("kind") == "eval"
             and str(r.get("phase", "")).startswith(("iter_", "baseline"))
             and not str(r.get("phase", "")).startswith("baseline_")],
            (len(train), final["success"]))
    print("\n| run | KL to reference | replay drift per step | replay clip fraction | ESS age 1-2 | ESS age 3-8 | ESS age 9+ |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run in args.runs + ([args.tiny] if args.tiny else []):
        train = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "train"]
        print(f"| {run.name}{' (tiny default)' if run == args.tiny else ''} | {_med(train, 'kl')} | "
              f"{_med(train, 'replay_drift_per_step')} | {_med(train, 'replay_clip_frac')} | {_med(train, 'ess/age_1-2')} | "
              f"{_med(train, 'ess/age_3-8')} | {_med(train, 'ess/age_9+')} |")
    for run in args.runs:  # Arithmetic: success by operation at the start of RL and delivered
        rows = {phase: _by_operation(run / "eval" / phase / "records.jsonl.gz") for phase in ("baseline", "final")}
        if all(rows.values()):
            kinds = sorted({k for r in rows.values() for k in r})
            print(f"\n{run.name} by operation | " + " | ".join(kinds) + " |\n|---|" + "---:|" * len(kinds))
            for phase, r in rows.items():
                print(f"| {phase} | " + " | ".join(f"{r[k][0]}/{r[k][1]}" for k in kinds) + " |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.4), squeeze=False)
        for ax, (name, (its, succ, evals, last)) in zip(axes[0], curves.items()):
            ax.plot(its, succ, color="0.6", lw=1, label="training episodes")
            if evals:
                ax.plot(*zip(*evals), "o-", color="C0", label="start and validation (held-out)")
            ax.plot(*last, "*", color="C3", markersize=11, label="delivered (128 held-out)")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("RL iteration")
            ax.set_ylim(0, 1)
            ax.xaxis.get_major_locator().set_params(integer=True)
        axes[0][0].set_ylabel("success")
        axes[0][0].legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"\n![curves]({args.plot})")


if __name__ == "__main__":
    main()
