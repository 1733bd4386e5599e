"""Train an LLM/VLM agent with IS-corrected GRPO and freshness-aware prioritized replay.

    python train.py                                   # the default: tiny model, FrozenLake 4x4 (docs/training.md)
    python train.py --config configs/sokoban_simple.yaml
    python train.py --iterations 100 --replay fresh --replay-ratio 1
    python train.py --resume runs/<name>              # continue exactly from the newest checkpoint
    python train.py --help                            # every flag, documented

A run: set up (run folder, the start model: by default the embedded tiny model pretrained on the
task's own transitions, cached) -> start of RL (held-out evaluation, KL reference, checkpoint 0)
-> the RL loop -> final evaluation and summary. One iteration: collect B tasks x G rollouts
with the current policy -> one on-policy update -> add the records to the replay buffer -> K
replay updates on prioritized batches (PER weights applied) -> periodic held-out evaluation.
Outputs go to ``runs/<run_name>/`` (docs/training.md). The run is ``learner/run.py`` (setup,
start_of_rl, loop, iteration, finish), its settings ``learner/config.py``, the loss
``learner/loss.py``, the updates ``learner/update.py``, pretraining ``learner/pretrain.py``.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the settings and run the job (under torchrun, rank 0 runs it and the other ranks
    serve its sharded updates); 0 when it finished, 2 with the reason on stderr when it cannot."""
    from learner.machine import choose_omp_wait_policy

    choose_omp_wait_policy()  # first: torch's OpenMP runtime reads OMP_WAIT_POLICY once, when torch loads
    import torch
    import yaml

    from learner import distributed
    from learner.build import serve_rank
    from learner.checkpoint import CheckpointError, DiskFullError, disk_full
    from learner.config import parse_config, precision_warning
    from learner.run import NonFiniteError, train
    from envs.registry import UnknownTaskError

    quiet_logging()
    try:
        cfg = parse_config(argv, description=__doc__)
    except (ValueError, CheckpointError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for warning in (silent_pretraining(cfg), precision_warning(cfg)):
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # process-wide: restored on return
    sharded = distributed.is_distributed()
    try:
        if sharded:  # torchrun: rank 0 runs the job, the other ranks serve its updates
            cfg.model.device = str(distributed.init(cfg.model.device))
            if distributed.rank() != 0:
                code = serve_rank(cfg)
                distributed.finish()
                distributed.exit_serving_rank(code)
            if cfg.pretrains_given_model():
                raise ValueError("pretraining a --model runs in one process: pretrain it in a run without torchrun, "
                                 "then train its checkpoint's model folder under torchrun")
        train(cfg)
    except (NonFiniteError, CheckpointError, DiskFullError, FileExistsError, ValueError, FloatingPointError,
            UnknownTaskError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not disk_full(exc):  # a full disk before the run folder is set up: no run to resume yet
            raise
        print(f"error: the disk is full ({str(exc).strip()[:300]}) before the run started: free space and "
              "start it again", file=sys.stderr)
        return 2
    finally:
        torch.use_deterministic_algorithms(previous)
        if sharded:
            distributed.finish()
    return 0


#: Pretraining steps from which a run without progress bars says that it will be quiet a while.
QUIET_PRETRAIN_STEPS = 100


def silent_pretraining(cfg) -> str:
    """What pretraining the run may do with no progress shown (``--no-progress``), where that is
    ``QUIET_PRETRAIN_STEPS`` steps or more (minutes on a CPU): both stages, each named by its
    flag, so a step count from a ``--config`` file is not a surprise; else ``""``."""
    if cfg.run.progress or not (cfg.pretrains_embedded_model() or cfg.pretrains_given_model()):
        return ""
    recipe = cfg.pretrain.recipe()
    most = (recipe.max_steps or 4 * recipe.steps) if recipe.until_exact > 0 else recipe.steps
    if most + recipe.follow_steps < QUIET_PRETRAIN_STEPS:
        return ""
    stages = [f"{recipe.steps} steps (--pretrain-steps)" + (f", up to {most} until the held-out exact rate reaches "
                                                              f"{recipe.until_exact:g}" if most > recipe.steps else "")]
    if recipe.follow_steps:
        stages.append(f"a second stage of {recipe.follow_steps} steps (--pretrain-follow-steps)")
    cached = "; the embedded model's is built once per task and recipe, then cached" \
        if cfg.pretrains_embedded_model() else ""
    return (f"the start model's pretraining, {', then '.join(stages)}, may take minutes with no progress shown "
            f"(--no-progress){cached}")


def quiet_logging() -> None:
    """INFO logs with times; the chatty libraries (matplotlib, PIL, httpx, bm25s, transformers) quieter."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("matplotlib", "PIL", "httpx", "bm25s"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
