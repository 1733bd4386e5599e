"""How far the policy has drifted from the data in its replay buffer, by the data's age.

    python -m learner.tools buffer-drift runs/<run> [runs/<run> ...]
    python -m learner.tools buffer-drift runs/<run>/checkpoints/iter_000100 --per-bucket 200
    python -m learner.tools buffer-drift runs/stale/frozenlake/*_s? --by-setting --json drift.jsonl  # + means
    python -m learner.tools buffer-drift --rows drift.jsonl --by-setting --plot drift.png  # again, from the rows

For each run (its last checkpoint) or checkpoint folder it loads the saved policy and the saved
replay buffer, recomputes the log-prob of every stored sampled token under that policy, and
prints per age bucket (optimizer steps since the trajectory was sampled): the trajectories and
tokens scored, their success rate, the mean KL(behaviour || now) estimated on the sampled tokens
(mean of log p_behaviour - log p_now), the token importance ratios' normalised effective sample
size ``(sum w)^2 / (n sum w^2)`` and the share of tokens outside the PPO clip ``|w - 1| > 0.2``.
This is the training's own ``ess/age_*`` metric at a finer age resolution and on the whole
buffer rather than on what happened to be replayed: what replaying data of each age would cost.
``--by-setting`` also prints, per setting (a run folder's name without its ``_s<seed>`` suffix)
and age bucket, the mean over the setting's runs with its 95% t-interval over seeds.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


EDGES = (0, 4, 8, 16, 32, 64, 128, 256)


def bucket_name(i: int) -> str:
    lo = EDGES[i]
    return f"{lo}+" if i == len(EDGES) - 1 else f"{lo}-{EDGES[i + 1] - 1}"


def checkpoint_of(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, else the newest checkpoint of the run folder."""
    from learner.checkpoint import list_checkpoints

    if (path / "trainer.pt").exists():
        return path
    found = list_checkpoints(path / "checkpoints")
    if not found:
        raise SystemExit(f"{path}: neither a checkpoint (no trainer.pt) nor a run folder with checkpoints")
    return found[-1]


def buffer_buckets(ckpt: Path, per_bucket: int, seed: int):
    """A checkpoint's policy (eval mode) and its replay buffer by age bucket: for each bucket
    that holds items, ``(bucket index, ages of the chosen items, the chosen trajectories,
    how many the bucket holds)``, at most ``per_bucket`` chosen at random (``seed``)."""
    import numpy as np
    import torch

    from agents.policies.policy import Policy
    from learner.state import REPLAY_FILE, TrajectoryCodec
    from replay.buffer import ReplayBuffer

    if not (ckpt / REPLAY_FILE).exists():
        raise SystemExit(f"{ckpt}: no {REPLAY_FILE} (a run with --replay none keeps no buffer)")
    step = torch.load(ckpt / "trainer.pt", weights_only=False)["state"]["global_step"]
    _, items, _, steps = ReplayBuffer.load(ckpt / REPLAY_FILE, TrajectoryCodec()).items()
    ages = step - np.asarray(steps, dtype=np.float64)
    which = np.clip(np.searchsorted(np.asarray(EDGES, dtype=np.float64), ages, side="right") - 1, 0, len(EDGES) - 1)
    rng = np.random.default_rng(seed)
    policy = Policy.from_pretrained(ckpt / "model")
    policy.model.eval()
    buckets = []
    for b in range(len(EDGES)):
        idx = np.flatnonzero(which == b)
        if idx.size == 0:
            continue
        if idx.size > per_bucket:
            idx = np.sort(rng.choice(idx, per_bucket, replace=False))
        buckets.append((b, ages[idx], [items[i] for i in idx], int((which == b).sum())))
    return policy, buckets


def drift(ckpt: Path, per_bucket: int, seed: int, micro_batch: int) -> list[dict]:
    import numpy as np
    import torch

    from learner.batch import batch_logprobs, make_batches
    from learner.loss import effective_sample_size

    policy, buckets = buffer_buckets(ckpt, per_bucket, seed)
    rows = []
    for b, ages, trajs, in_buffer in buckets:
        gaps = []
        with torch.no_grad():
            for batch in make_batches(trajs, micro_batch=micro_batch):
                now = batch_logprobs(policy, batch)
                mask = batch.mask.bool()
                gaps.append((batch.behavior_logprobs[mask] - now[mask]).double())
        gap = torch.cat(gaps)
        w = torch.exp(-gap)
        rows.append({"bucket": bucket_name(b), "age_mean": float(ages.mean()), "trajectories": len(trajs),
                     "in_buffer": in_buffer, "tokens": int(gap.numel()),
                     "success": float(np.mean([t.success for t in trajs])), "kl": float(gap.mean()),
                     "ess": effective_sample_size(w),
                     "outside_clip": float(((w - 1).abs() > 0.2).double().mean())})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", type=Path, help="run folders (their last checkpoint) or checkpoint folders")
    parser.add_argument("--rows", type=Path, default=None,
                        help="read the rows a --json run wrote (plain or .gz) instead of scoring checkpoints")
    parser.add_argument("--per-bucket", type=int, default=300, help="trajectories scored per age bucket at most (300)")
    parser.add_argument("--seed", type=int, default=0, help="which trajectories a full bucket scores")
    parser.add_argument("--micro-batch", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write every row here (JSON lines)")
    parser.add_argument("--by-setting", action="store_true", help="also the mean over seeds per setting and age")
    parser.add_argument("--plot", type=Path, default=None,
                        help="also draw KL, ESS and the share outside the clip against age per setting (PNG)")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = []
    if args.rows:
        from learner.report import read_metrics  # JSON lines; "x.jsonl" is read from "x.jsonl.gz" when archived

        out = read_metrics(args.rows.with_suffix("") if args.rows.suffix == ".gz" else args.rows)
    elif not args.runs:
        parser.error("give run or checkpoint folders, or --rows")
    header = (f"{'checkpoint':<44} {'age':>7} {'mean age':>8} {'scored':>6} {'in buffer':>9} {'tokens':>7} "
              f"{'success':>7} {'KL':>8} {'ESS':>6} {'outside clip':>12}")
    print(header)

    def show(name: str, row: dict) -> None:
        print(f"{name:<44} {row['bucket']:>7} {row['age_mean']:>8.1f} {row['trajectories']:>6} {row['in_buffer']:>9} "
              f"{row['tokens']:>7} {row['success']:>7.3f} {row['kl']:>8.4f} {row['ess']:>6.3f} "
              f"{row['outside_clip']:>12.3f}", flush=True)

    for row in out:
        show("/".join(Path(row["checkpoint"]).parts[-3:]), row)
    for run in [] if args.rows else args.runs:
        ckpt = checkpoint_of(run)
        for row in drift(ckpt, args.per_bucket, args.seed, args.micro_batch):
            out.append({"checkpoint": str(ckpt), **row})
            show("/".join(ckpt.parts[-3:]), row)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in out))
    if args.by_setting:
        print()
        print(by_setting(out))
    if args.plot:
        plot(out, args.plot)
        print(f"plot: {args.plot}")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Mean over a setting's runs (95% interval) of each drift measure against the bucket's mean age."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    from learner.report import seed_interval

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for k, (setting, buckets) in enumerate(grouped(rows).items()):
        order = list(buckets.values())
        ages = [float(np.mean([r["age_mean"] for r in rs])) for rs in order]
        for ax, key in zip(axes, ("kl", "ess", "outside_clip")):
            vals = [[r[key] for r in rs] for rs in order]
            mean = [float(np.mean(v)) for v in vals]
            lo_hi = [seed_interval(v) for v in vals]
            ax.plot(ages, mean, "o-", color=f"C{k}", label=f"{setting} ({max(len(v) for v in vals)} runs)")
            ax.fill_between(ages, [a for a, _ in lo_hi], [b for _, b in lo_hi], color=f"C{k}", alpha=0.12)
    for ax, title in zip(axes, ("KL(behaviour || now) per sampled token", "token IS effective sample size (normalised)",
                                "share of tokens outside the clip |w - 1| > 0.2")):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # ages as numbers, not 2x10^0
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("age of the stored trajectory (optimizer steps)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("How far the policy has moved from the data in its replay buffer, by the data's age")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def setting_of(checkpoint: str) -> str:
    """The setting a checkpoint's run belongs to: its run folder's name without ``_s<seed>``."""
    parts = Path(checkpoint).parts
    run = parts[-3] if len(parts) >= 3 and parts[-2] == "checkpoints" else Path(checkpoint).name
    return re.sub(r"_s\d+$", "", run)


def grouped(rows: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """The rows per setting (sorted) and age bucket (youngest first)."""
    order = {bucket_name(i): i for i in range(len(EDGES))}
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in sorted(rows, key=lambda r: (setting_of(r["checkpoint"]), order[r["bucket"]])):
        groups.setdefault(setting_of(r["checkpoint"]), {}).setdefault(r["bucket"], []).append(r)
    return groups


def by_setting(rows: list[dict]) -> str:
    """Mean [95% CI over runs] of KL, ESS and the share outside the clip per setting and age bucket."""
    from learner.report import seed_interval

    lines = [f"{'setting':<20} {'age':>7} {'runs':>4} {'KL [95% CI]':>26} {'ESS [95% CI]':>24} {'outside clip [95% CI]':>24}"]
    for setting, bucket, rs in ((s, b, rs) for s, buckets in grouped(rows).items() for b, rs in buckets.items()):
        cells = []
        for key, fmt in (("kl", "{:.4f}"), ("ess", "{:.3f}"), ("outside_clip", "{:.3f}")):
            vals = [r[key] for r in rs]
            lo, hi = seed_interval(vals)
            cells.append(f"{fmt.format(sum(vals) / len(vals))} [{fmt.format(lo)}, {fmt.format(hi)}]")
        lines.append(f"{setting:<20} {bucket:>7} {len(rs):>4} {cells[0]:>26} {cells[1]:>24} {cells[2]:>24}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
