"""Seed blocks: the tasks a run trains, pretrains and is evaluated on never overlap.

Task seeds are plain integers handed to ``env.reset(seed=...)``. Each use has its own block:

- training: ``run_seed * TRAIN_SEED_BLOCK + iteration * B + b`` (a function of the iteration
  counter, so a resumed run draws the same tasks);
- pretraining: ``PRETRAIN_SEED_BASE + run_seed * PRETRAIN_SEED_BLOCK + episode``;
- held-out evaluation (the test tasks: start of RL and final): from ``EVAL_SEED_BASE`` on, the
  same for every run and for ``python -m agents.evaluate``;
- validation (the periodic evaluations, which pick the iteration a run delivers, ``--select``):
  from ``VALID_SEED_BASE`` on, disjoint from training, pretraining and the test tasks, so the
  choice never sees the tasks the delivered agent is scored on.
"""

from __future__ import annotations

from agents.evaluate import EVAL_SEED_OFFSET

TRAIN_SEED_BLOCK = 100_000_000
PRETRAIN_SEED_BASE = 1_500_000_000
PRETRAIN_SEED_BLOCK = 1_000_000
EVAL_SEED_BASE = EVAL_SEED_OFFSET
VALID_SEED_BASE = 2_000_000_000  # test seeds are far below (200 final episodes), 2**31 far above
#: Run seeds must be below this, so training seeds stay under the pretraining block.
MAX_RUN_SEED = PRETRAIN_SEED_BASE // TRAIN_SEED_BLOCK


def train_seed(run_seed: int, iteration: int, tasks_per_iter: int, b: int) -> int:
    """Task seed of task ``b`` of ``iteration``."""
    seed = run_seed * TRAIN_SEED_BLOCK + iteration * tasks_per_iter + b
    if seed >= (run_seed + 1) * TRAIN_SEED_BLOCK:
        raise ValueError("ran out of training seeds for this run seed")
    return seed


def pretrain_seed(run_seed: int, episode: int) -> int:
    """Task seed of pretraining episode ``episode`` (wraps inside the run seed's block)."""
    return PRETRAIN_SEED_BASE + (run_seed % 400) * PRETRAIN_SEED_BLOCK + episode % PRETRAIN_SEED_BLOCK
