"""One short sharded job that ends the way ``train.py``'s does, run under torchrun: FSDP2 over
gloo on a 3-block model, three Adam steps, a sharded checkpoint, rank 0's start and stop
broadcasts, then leaving the group. ``old``: ``destroy_process_group`` and a normal interpreter
exit on every rank; ``new``: ``learner.distributed.finish`` and ``exit_serving_rank`` on the
non-zero ranks, as ``train.py`` ends now; ``threads``: the old ending, printing each rank's
threads and the references to its process group after ``destroy_process_group``.

    python -m torch.distributed.run --standalone --nproc_per_node 2 experiments/sharded_teardown/teardown.py new /tmp/ck
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch

from learner import distributed


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Model(torch.nn.Module):
    _no_split_modules = ["Block"]  # what shard_policy shards one by one

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum()


class _Policy:
    def __init__(self) -> None:
        self.model = Model()


def main(mode: str, checkpoint: str) -> int:
    distributed.init("cpu")
    torch.manual_seed(0)
    policy = _Policy()
    distributed.shard_policy(policy, torch.float32)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
    for _ in range(3):
        policy.model(torch.randn(8, 64)).backward()
        optimizer.step()
        optimizer.zero_grad()
    rank = distributed.rank()
    distributed.save_sharded(policy, optimizer, Path(checkpoint) / f"rank{rank}")
    if rank == 0:
        distributed.broadcast(("start", None))
        distributed.broadcast(("stop", None))
    else:
        distributed.broadcast()
        distributed.broadcast()
    del policy, optimizer
    if mode in ("old", "threads"):
        group = torch.distributed.distributed_c10d._get_default_group()
        torch.distributed.destroy_process_group()
        if mode == "threads":
            gc.collect()
            names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
            print(f"rank {rank}: {len(names)} threads after destroy_process_group: {', '.join(names)}; "
                  f"{sys.getrefcount(group) - 2} other references to the group", flush=True)
        return 0
    distributed.finish()  # rank 0 has broadcast its stop: finish only leaves the group
    if rank != 0:
        distributed.exit_serving_rank(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
