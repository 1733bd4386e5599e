"""The drift pilot's table: per setting, held-out success at the start and the end, the
per-update drift the training measured, and the buffer's KL, ESS and clipped share by age (the
rows ``learner.tools buffer-drift --json`` wrote), with the KL per optimizer step of age.

    python -m experiments.paper_real.pilot_table docs/data/paper_real/pilot   # the archived pilot
    python -m experiments.paper_real.pilot_table runs/paper_real/pilot [--drift FILE]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from learner.report import read_metrics


def run_row(run: Path) -> dict:
    rows = read_metrics(run / "metrics.jsonl")
    trains = [r for r in rows if r.get("kind") == "train"]
    evals = {r["phase"]: r for r in rows if r.get("kind") == "eval"}
    drift = [r["replay_drift_per_step"] for r in trains if "replay_drift_per_step" in r]
    clip = [r["replay_clip_frac"] for r in trains if "replay_clip_frac" in r]
    cfg = {}
    if (run / "config.yaml").exists():
        import yaml

        cfg = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8")) or {}
    return {"run": run.name, "lr": cfg.get("lr"), "kl_coef": cfg.get("kl_coef"), "replay": cfg.get("replay"),
            "start": evals.get("baseline", {}).get("success"), "final": evals.get("final", {}).get("success"),
            "final_ci": (evals.get("final", {}).get("success_ci_low"), evals.get("final", {}).get("success_ci_high")),
            "train_success": [round(r["success"], 3) for r in trains],
            "drift_median": statistics.median(drift) if drift else None,
            "clip_mean": statistics.fmean(clip) if clip else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--drift", type=Path, default=None, help="buffer-drift --json rows (default: FOLDER/drift.jsonl)")
    args = parser.parse_args(argv)
    runs = sorted(p.parent for p in args.folder.glob("*_s*/summary.json"))
    print("| setting | lr | KL penalty | replay | held-out start -> final (64 tasks) | training success by iteration "
          "| ESS decay per step (median) | replayed tokens clipped |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        r = run_row(run)
        lo, hi = r["final_ci"]
        drift = f"{r['drift_median']:.3f}" if r["drift_median"] is not None else "-"
        clip = f"{r['clip_mean']:.1%}" if r["clip_mean"] is not None else "-"
        print(f"| {r['run']} | {r['lr']:g} | {r['kl_coef']:g} | {r['replay']} | {r['start']:.3f} -> {r['final']:.3f} "
              f"[{lo:.3f}, {hi:.3f}] | {' '.join(f'{s:.2f}' for s in r['train_success'])} | {drift} | {clip} |")
    drift_file = args.drift or args.folder / "drift.jsonl"  # read from drift.jsonl.gz where archived
    if drift_file.exists() or Path(f"{drift_file}.gz").exists():
        print()
        print("| setting | age bucket | mean age | KL per token | KL per step of age | ESS | outside the clip |")
        print("|---|---|---|---|---|---|---|")
        for d in read_metrics(drift_file):
            name = Path(d["checkpoint"]).parts[-3]
            print(f"| {name} | {d['bucket']} | {d['age_mean']:.0f} | {d['kl']:.4f} | {d['kl'] / d['age_mean']:.4f} "
                  f"| {d['ess']:.3f} | {d['outside_clip']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
