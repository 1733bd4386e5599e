"""How much gradient signal a replayed trajectory still carries, against what it carried when it
was collected: per age bucket of a checkpoint's replay buffer, the share of items with a zero
advantage (all-equal groups), the mean |advantage|, and on the sampled tokens the mean of
``1 - p`` (the size of the sampled token's log-prob gradient with respect to its own logit) and of
``|A| (1 - p)``, under the behaviour policy (the item's signal as an on-policy sample) and under
the checkpoint's policy (its signal as a replayed sample).

    python -m experiments.paper_real.replay_signal runs/<run>/checkpoints/iter_000008 [--per-bucket 128]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--per-bucket", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    from agents.policies.policy import Policy
    from learner.batch import batch_logprobs, make_batches
    from learner.state import REPLAY_FILE, TrajectoryCodec
    from learner.tools.buffer_drift import EDGES, bucket_name
    from replay.buffer import ReplayBuffer

    torch.set_num_threads(args.threads)
    step = torch.load(args.checkpoint / "trainer.pt", weights_only=False)["state"]["global_step"]
    _, items, _, steps = ReplayBuffer.load(args.checkpoint / REPLAY_FILE, TrajectoryCodec()).items()
    ages = step - np.asarray(steps, dtype=np.float64)
    which = np.clip(np.searchsorted(np.asarray(EDGES, dtype=np.float64), ages, side="right") - 1, 0, len(EDGES) - 1)
    policy = Policy.from_pretrained(args.checkpoint / "model")
    policy.model.eval()
    rng = np.random.default_rng(0)
    print(f"{args.checkpoint} (optimizer step {step}, {len(items)} stored trajectories)")
    print("| age | items | zero advantage | mean abs advantage | 1 - p, collected | 1 - p, now | |A|(1 - p), collected "
          "| |A|(1 - p), now | now / collected |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b in range(len(EDGES)):
        idx = np.flatnonzero(which == b)
        if idx.size == 0:
            continue
        if idx.size > args.per_bucket:
            idx = np.sort(rng.choice(idx, args.per_bucket, replace=False))
        then, now, signal_then, signal_now, adv = [], [], [], [], []
        with torch.no_grad():
            for batch in make_batches([items[i] for i in idx], micro_batch=64):
                lp = batch_logprobs(policy, batch).double()
                mask = batch.mask.bool()
                a = batch.advantages.double().abs()[:, None].expand_as(lp)
                p_then, p_now = batch.behavior_logprobs.double().exp(), lp.exp()
                then.append((1 - p_then)[mask])
                now.append((1 - p_now)[mask])
                signal_then.append((a * (1 - p_then))[mask])
                signal_now.append((a * (1 - p_now))[mask])
                adv.append(batch.advantages.double().abs())
        adv_all = torch.cat(adv)
        s_then, s_now = torch.cat(signal_then).mean().item(), torch.cat(signal_now).mean().item()
        print(f"| {bucket_name(b)} | {idx.size} | {(adv_all == 0).double().mean().item():.2f} | "
              f"{adv_all.mean().item():.3f} | {torch.cat(then).mean().item():.3f} | {torch.cat(now).mean().item():.3f} | "
              f"{s_then:.4f} | {s_now:.4f} | {s_now / s_then if s_then else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
