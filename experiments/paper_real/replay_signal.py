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

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--per-bucket", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    from learner.batch import batch_logprobs, make_batches
    from learner.tools.buffer_drift import buffer_buckets, bucket_name

    torch.set_num_threads(args.threads)
    policy, buckets = buffer_buckets(args.checkpoint, args.per_bucket, seed=0)
    print(f"{args.checkpoint} ({sum(n for *_, n in buckets)} stored trajectories)")
    print("| age | items | zero advantage | mean abs advantage | 1 - p, collected | 1 - p, now | |A|(1 - p), collected "
          "| |A|(1 - p), now | now / collected |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, _, trajs, _ in buckets:
        then, now, signal_then, signal_now, adv = [], [], [], [], []
        with torch.no_grad():
            for batch in make_batches(trajs, micro_batch=64):
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
        print(f"| {bucket_name(b)} | {len(trajs)} | {(adv_all == 0).double().mean().item():.2f} | "
              f"{adv_all.mean().item():.3f} | {torch.cat(then).mean().item():.3f} | {torch.cat(now).mean().item():.3f} | "
              f"{s_then:.4f} | {s_now:.4f} | {s_now / s_then if s_then else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
