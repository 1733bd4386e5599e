"""What the sharded learner's one replay owner costs per update: rank 0 broadcasts the drawn
batch's records (``learner.distributed.encode_update`` -> ``broadcast``) to the other ranks,
beside the one-process update on the same batch.

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 -m benchmarks.sharded_broadcast_bench
    ... -m benchmarks.sharded_broadcast_bench --tasks 8 --group-size 8 --repeats 10

The batch is the default run's: ``--tasks`` x ``--group-size`` FrozenLake episodes of the
embedded model in ``window:0`` context (one sample per turn). Rank 0 prints the message's size,
the median seconds of ``--repeats`` broadcasts (gloo on the CPU; every rank decodes what it
gets), and the median seconds of a one-process update (``policy_update``, KL to a reference)
on the same records, with their ratio. Results: docs/scaling.md, "The sharded learner".
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    from learner import distributed

    distributed.init("cpu")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    message, records, policy = None, None, None
    if rank == 0:
        from agents.policies.policy import Policy
        from agents.policies.tiny import build_tiny_model
        from agents.rollout.runner import Runner
        from learner.advantages import assign_group_advantages

        torch.manual_seed(0)
        policy = Policy.from_pretrained(build_tiny_model("text"))
        runner = Runner(policy, "freshper/FrozenLake-v0", group_size=args.group_size, context="window:0",
                        env_kwargs={"feedback": False}, max_new_tokens=8, seed=1)
        records, _ = runner.collect(list(range(1000, 1000 + args.tasks)), policy_version=0)
        assign_group_advantages(records)
        message = distributed.encode_update(records, np.ones(len(records)), np.zeros(len(records)), True, 3e-4)
    seconds = []
    for _ in range(args.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        got = distributed.broadcast(message if rank == 0 else None)
        distributed.decode_update(got)
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
    if rank == 0:
        from learner.loss import LossSettings
        from learner.update import policy_update

        ref = Policy.from_pretrained(build_tiny_model("text"))
        ref.model.requires_grad_(False)
        optimizer = torch.optim.Adam(policy.model.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        updates = []
        for _ in range(4):
            t0 = time.perf_counter()
            policy_update(policy, ref, optimizer, scheduler, records, np.ones(len(records)), np.zeros(len(records)),
                          loss_cfg=LossSettings(kl_coef=0.04), on_policy=True)
            updates.append(time.perf_counter() - t0)
        size = len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        bcast, update = statistics.median(seconds[1:]), statistics.median(updates[1:])
        one, five, _ = os.getloadavg()
        print(f"{len(records)} episodes, {sum(len(r.samples) for r in records)} samples; message {size / 1e3:.0f} kB; "
              f"{dist.get_world_size()} ranks (gloo), load average {one:.2f} / {five:.2f}")
        print(f"broadcast + decode: {bcast * 1e3:.1f} ms (median of {args.repeats}); one-process update on the same "
              f"batch: {update * 1e3:.0f} ms; broadcast / update = {bcast / update:.3f}")
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank != 0:  # without finalization: the group's threads outlive it (learner.distributed)
        distributed.exit_serving_rank(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
