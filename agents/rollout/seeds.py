"""The seed scheme, in one place: which tasks a run trains, pretrains, validates and is tested
on, and what seeds the sampling of each collect.

**Task seeds** are plain integers handed to ``env.reset(seed=...)``. Each use has its own block,
so the tasks a run trains, pretrains and is evaluated on never overlap:

- training: ``run_seed * TRAIN_SEED_BLOCK + iteration * B + b`` (a function of the iteration
  counter, so a resumed run draws the same tasks);
- pretraining: ``PRETRAIN_SEED_BASE + run_seed * PRETRAIN_SEED_BLOCK + episode``;
- held-out evaluation (the test tasks: start of RL and final): from ``EVAL_SEED_BASE`` on, the
  same for every run and for ``python -m agents.evaluate``;
- validation (the periodic evaluations, which pick the iteration a run delivers, ``--select``):
  from ``VALID_SEED_BASE`` on, disjoint from training, pretraining and the test tasks, so the
  choice never sees the tasks the delivered agent is scored on;
- diagnostics (the policy's action distributions on fixed states): from
  ``DIAGNOSTIC_SEED_BASE`` on.

**Sampling seeds** seed the random numbers of one collect (token sampling, the learner's
iteration): :func:`counter_seed` of a base seed and a counter (a run's iteration, a runner's
call), so everything random in an iteration follows from its counter and a resumed run
repeats it; :func:`shard_rng_seed` for each shard of a collect split across processes; and
:func:`request_seed` for each request a served model answers.
"""

from __future__ import annotations

TRAIN_SEED_BLOCK = 100_000_000
PRETRAIN_SEED_BASE = 1_500_000_000
PRETRAIN_SEED_BLOCK = 1_000_000
EVAL_SEED_BASE = 1_900_000_000
VALID_SEED_BASE = 2_000_000_000  # test seeds are far below (200 final episodes), 2**31 far above
DIAGNOSTIC_SEED_BASE = 2_100_000_000
#: Run seeds must be below this, so training seeds stay under the pretraining block.
MAX_RUN_SEED = PRETRAIN_SEED_BASE // TRAIN_SEED_BLOCK

#: Sampling seed of counter ``k`` from base seed ``s``: ``s * COUNTER_SEED_STRIDE + k`` (a prime,
#: so the seeds of different base seeds do not meet for any counter a run reaches).
COUNTER_SEED_STRIDE = 1_000_003
#: The step between the sampling seeds of a collect's shards, per task of offset (a prime).
SHARD_SEED_STRIDE = 1_000_000_007


def train_seed(run_seed: int, iteration: int, tasks_per_iter: int, b: int) -> int:
    """Task seed of task ``b`` of ``iteration``."""
    seed = run_seed * TRAIN_SEED_BLOCK + iteration * tasks_per_iter + b
    if seed >= (run_seed + 1) * TRAIN_SEED_BLOCK:
        raise ValueError("ran out of training seeds for this run seed")
    return seed


def pretrain_seed(run_seed: int, episode: int) -> int:
    """Task seed of pretraining episode ``episode`` (wraps inside the run seed's block)."""
    return PRETRAIN_SEED_BASE + (run_seed % 400) * PRETRAIN_SEED_BLOCK + episode % PRETRAIN_SEED_BLOCK


def counter_seed(seed: int, counter: int) -> int:
    """The sampling seed of call or iteration ``counter`` of something seeded ``seed``."""
    return int(seed) * COUNTER_SEED_STRIDE + int(counter)


def shard_rng_seed(rng_seed: int, first_task: int) -> int:
    """The sampling seed of the shard starting at task ``first_task`` of a request seeded
    ``rng_seed``: the request's own seed for the first shard, so one shard is the plain runner."""
    return int(rng_seed) if first_task == 0 else (int(rng_seed) + SHARD_SEED_STRIDE * int(first_task)) % 2**63


def request_seed(rng_seed: int, task_seed: int, turn: int) -> int:
    """The ``seed`` of the chat-completions request for turn ``turn`` of task ``task_seed`` in a
    collect seeded ``rng_seed`` (a served model's sampling; below 2**31, as servers accept)."""
    return (counter_seed(rng_seed, task_seed * 1009 + turn)) % (2 ** 31)
