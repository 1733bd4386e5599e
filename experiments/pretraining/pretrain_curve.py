"""How fast the embedded model learns a task's dynamics: held-out curves of its pretraining.

    python experiments/pretraining/pretrain_curve.py --env-id freshper/FrozenLake-v0 --steps 400 --every 50
    python experiments/pretraining/pretrain_curve.py --env-id freshper/FrozenLakeVision-v0 --steps 1200 --every 100
    python experiments/pretraining/pretrain_curve.py --env-id freshper/Sokoban-v0 --model .cache/freshper/pretrained-Sokoban-v0-s0-<key> --steps 0

Pretrains the embedded tiny model of the task's modality with ``learner.pretrain`` (the recipe
``train.py`` uses; ``--batch``, ``--lr``, ``--dynamics`` change it) and every ``--every`` steps
measures, on 64 held-out transitions from other tasks: the per-token negative log-likelihood of
dynamics and format targets, and how often greedy decoding writes the dynamics target exactly
(the next board, or how the episode ended): a direct measure of whether the model reads the
state it is shown. With ``--observe`` (observation examples in the mix) it also measures held-out
observation examples (the state as shown, e.g. an image, -> the state as text): whether the
model perceives the state at all, apart from predicting what a move does, and the share of the
target's numbers written right in their place. ``--model PATH``
starts from a saved model folder (e.g. a cached pretrained default) instead of the untrained
embedded one; with ``--steps 0`` it only measures that model. ``--policy-probe N`` also measures
whether the move distribution reads the state (``learner.diagnostics``: action spread, and the
mass on moves that do nothing beside a board-blind model's) on N random-play states. Prints one table row per measurement; ``--json PATH`` also writes them.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch



def observe_rates(policy, examples) -> tuple[float, float]:
    """Greedy transcriptions of held-out observation examples: the share written exactly, and the
    share of the target's numbers written right in their place (the n-th number of the reply
    against the n-th of the target; a missing one is wrong), which shows partial perception that
    the exact rate hides (a chart's values, a board's counts)."""
    import numpy as np

    from learner.pretrain import greedy_replies

    exact, right, total = [], 0, 0
    for text, ex in zip(greedy_replies(policy, examples), examples):
        exact.append(text == ex.reply)
        want, got = re.findall(r"\d+", ex.reply), re.findall(r"\d+", text)
        right += sum(a == b for a, b in zip(want, got))
        total += len(want)
    return float(np.mean(exact)), (right / total if total else float("nan"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-id", default="freshper/FrozenLake-v0")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dynamics", type=float, default=0.5)
    parser.add_argument("--observe", type=float, default=0.0, help="share of observation examples (within --dynamics)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--model", default=None, help="start from this model folder (default: the untrained embedded model)")
    parser.add_argument("--env-kwargs", type=json.loads, default=None, metavar="JSON",
                        help='keyword arguments of the task, over the trainer\'s defaults, e.g. \'{"preset": "simple", "board": "letters"}\'')
    parser.add_argument("--save", default=None, metavar="DIR",
                        help="save the model after the last step (train.py --model DIR --pretrain-steps 0 trains from it)")
    parser.add_argument("--policy-probe", type=int, default=0, metavar="STATES",
                        help="also measure the move distribution on this many random-play states: action spread and "
                             "illegal mass beside the board-blind reference (learner.diagnostics)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import envs
    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import build_tiny_model
    from learner.pretrain import PretrainSettings, TransitionStreams, encode, exact_rate, held_out_dynamics, pretrain
    from learner.update import nll_per_sample

    modality = envs.task_spec(args.env_id).modality
    kwargs = {**default_env_kwargs(args.env_id, "window:0"), **(args.env_kwargs or {})}
    policy = Policy.from_pretrained(args.model or build_tiny_model(modality, seed=args.seed))
    vision = policy.is_vision
    dyn = held_out_dynamics(args.env_id, kwargs, args.seed, vision, rounds=1)  # the pretraining's exact-rate block
    held = TransitionStreams(args.env_id, kwargs, 64, args.seed + 104_730, 0.0, vision)
    fmt = held.examples()
    held.close()
    obs = []
    if args.observe > 0:  # held-out observation examples: the state as shown -> the state as text
        held = TransitionStreams(args.env_id, kwargs, 64, args.seed + 104_731, 1.0, vision, observe_fraction=1.0)
        obs = held.examples()
        held.close()
    dyn_s, dyn_i = encode(policy, dyn)
    fmt_s, fmt_i = encode(policy, fmt)
    obs_s, obs_i = encode(policy, obs) if obs else ([], None)
    rows: list[dict] = []
    start = time.monotonic()

    def measure(step: int) -> None:
        row = {"step": step, "seconds": round(time.monotonic() - start, 1),
               "dynamics_nll": float(nll_per_sample(policy, dyn_s, dyn_i).mean()),
               "format_nll": float(nll_per_sample(policy, fmt_s, fmt_i).mean()), "dynamics_exact": exact_rate(policy, dyn)}
        line = (f"{row['step']:>6} {row['seconds']:>8} {row['dynamics_nll']:>12.3f} {row['format_nll']:>10.3f} "
                f"{row['dynamics_exact']:>16.2f}")
        if args.policy_probe:
            from learner.diagnostics import policy_diagnostics

            diag = policy_diagnostics(policy, args.env_id, kwargs, states=args.policy_probe, probes=0)
            row.update({k: diag[k] for k in ("action_spread", "illegal_mass", "blind_illegal_mass") if k in diag})
            line += "".join(f" {row.get(k, float('nan')):>13.3f}" for k in ("action_spread", "illegal_mass", "blind_illegal_mass"))
        if obs:
            exact, numbers = observe_rates(policy, obs)
            row.update(observe_nll=float(nll_per_sample(policy, obs_s, obs_i).mean()), observe_exact=exact,
                       observe_numbers=numbers)
            line += f" {row['observe_nll']:>11.3f} {row['observe_exact']:>13.2f} {numbers:>15.2f}"
        rows.append(row)
        print(line, flush=True)

    print(f"{args.env_id}: batch {args.batch}, lr {args.lr}, dynamics share {args.dynamics}, observation share {args.observe}")
    print(f"{'step':>6} {'seconds':>8} {'dynamics nll':>12} {'format nll':>10} {'next state exact':>16}"
          + (f" {'action spread':>13} {'illegal mass':>13} {'blind ref':>13}" if args.policy_probe else "")
          + (f" {'observe nll':>11} {'observe exact':>13} {'observe numbers':>15}" if obs else ""))
    measure(0)
    torch.manual_seed(args.seed)
    if args.steps > 0:
        pretrain(policy, args.env_id, kwargs, PretrainSettings(steps=args.steps, batch=args.batch, lr=args.lr,
                                                             dynamics_fraction=args.dynamics, observe_fraction=args.observe),
                 seed=args.seed,
                 on_step=lambda step, st: measure(step + 1) if (step + 1) % args.every == 0 else None)
    if args.save:
        policy.save_pretrained(args.save)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
