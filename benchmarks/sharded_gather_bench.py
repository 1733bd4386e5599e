"""What loading the sharded learner's weights into rank 0's sampler costs: the tensor-by-tensor
stream (``learner.distributed.gather_into``) beside gathering the whole state first
(``full_state``, then a copy), on a randomly initialised Qwen2.5-size model.

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.sharded_gather_bench
    ... -m benchmarks.sharded_gather_bench --model qwen2.5-1.5b --repeats 3

Every rank holds its FSDP2 shard in fp32; rank 0 also holds the unsharded sampler (fp32 on the
CPU). Rank 0 prints, per way, the median seconds of ``--repeats`` gathers (run alternately) and
the largest rise of each rank's resident set above its level before a gather (sampled every
2 ms). Results: docs/performance_scale.md, "The sharded learner on a CPU".
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def whole_then_copy(policy, sampler) -> None:
    """The whole-state way: every weight gathered to rank 0's CPU at once, then copied."""
    from learner import distributed

    state = distributed.full_state(policy)
    if sampler is not None:
        with torch.no_grad():
            own = sampler.model.state_dict()
            for key, value in state.items():
                own[key].copy_(value)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", type=Path, default=Path(".cache/real_scale"))
    args = p.parse_args(argv)
    from agents.policies.policy import Policy
    from benchmarks.real_scale import Peak, model_folder
    from learner import distributed

    distributed.init("cpu")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if rank == 0:
        model_folder(args.model, args.cache)  # built once, before the other rank reads it
    dist.barrier()
    folder = model_folder(args.model, args.cache)
    policy = Policy.from_pretrained(folder, device="cpu", dtype=torch.float32)
    distributed.shard_policy(policy, torch.float32)
    sampler = Policy.from_pretrained(folder, device="cpu", dtype=torch.float32) if rank == 0 else None
    ways = {"stream (gather_into)": lambda: distributed.gather_into(policy, sampler),
            "whole state, then copy": lambda: whole_then_copy(policy, sampler)}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    rise: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.repeats):
        for way, gather in ways.items():
            dist.barrier()
            with Peak("cpu") as peak:
                before = peak.peak
                gather()
            seconds[way].append(peak.seconds)
            rise[way].append(peak.peak - before)
    rows = [(way, statistics.median(seconds[way]), max(rise[way])) for way in ways]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        params = sum(t.numel() for t in sampler.model.state_dict().values())
        print(f"{args.model}: {params / 1e6:,.0f}M weights ({params * 4 / 2**30:.2f} GiB in fp32), "
              f"{dist.get_world_size()} ranks, gloo, median of {args.repeats}")
        print(f"{'way':<24} {'seconds':>8} {'rank 0 rise':>12} {'rank 1 rise':>12}")
        for i, (way, sec, up) in enumerate(rows):
            print(f"{way:<24} {sec:>8.2f} {up / 2**30:>10.2f} G {everyone[1][i][2] / 2**30:>10.2f} G")
        base = rows[1]
        print(f"stream / whole: {rows[0][1] / base[1]:.2f}x the time, "
              f"{rows[0][2] / max(base[2], 1):.2f}x rank 0's memory rise")
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:  # without finalization: the group's threads outlive it (learner.distributed)
        distributed.exit_serving_rank(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
