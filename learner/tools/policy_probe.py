"""What a saved model's moves depend on: the policy diagnostics of ``learner/diagnostics.py``.

    python -m learner.tools policy-probe .cache/freshper/pretrained-FrozenLake-v0-s0-<key>
    python -m learner.tools policy-probe <model> <model> --env-id freshper/FrozenLakeVision-v0 --reasoning state
    python -m learner.tools policy-probe runs/<run>/checkpoints/<step>/policy

For each model (a pretrained start, a checkpoint's policy, any local model folder) it prints the
action spread across random-play states, the counterfactual shift, and the probability the
policy puts on moves the state does not allow (``illegal_mass``) beside what a board-blind
model fitted to the pretraining's random legal moves puts there (``blind_illegal_mass``). The
pretraining's format replies are random *effective* moves (legal moves that change the state), so its start should be well below the
blind reference on any task it reads; a start that is not has not tied its moves to the state.
``--reasoning lookahead|state`` scores each answer after the state's true think text, as runs
trained with it are evaluated.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from envs.capabilities import REASONINGS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", type=Path, help="model folders")
    parser.add_argument("--env-id", default="freshper/FrozenLake-v0", help="the task (default freshper/FrozenLake-v0)")
    parser.add_argument("--env-kwargs", default='{"feedback": false}', help="JSON keyword arguments of the task")
    parser.add_argument("--reasoning", default="none", choices=REASONINGS)
    parser.add_argument("--states", type=int, default=96, help="random-play states (default 96)")
    parser.add_argument("--probes", type=int, default=64, help="counterfactual probe pairs (default 64)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    import json

    import torch

    from agents.policies.policy import Policy
    from learner.diagnostics import policy_diagnostics

    models, env_id = args.models, args.env_id
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = json.loads(args.env_kwargs)
    print(f"{'model':<52} {'action spread':>13} {'illegal mass':>12} {'blind ref':>9} {'counterfactual [95% CI]':>32}")
    for folder in models:
        if not (folder / "config.json").exists():
            raise SystemExit(f"{folder}: not a model folder (no config.json)")
        policy = Policy.from_pretrained(folder)
        out = policy_diagnostics(policy, env_id, kwargs, states=args.states, probes=args.probes,
                                 reasoning=args.reasoning)
        cells = [f"{out[k]:.3f}" if k in out else "n/a" for k in ("action_spread", "illegal_mass", "blind_illegal_mass")]
        shift = f"{out['counterfactual_shift']:+.3f}" if "counterfactual_shift" in out else "n/a"
        if "counterfactual_ci_low" in out:
            shift += f" [{out['counterfactual_ci_low']:+.3f}, {out['counterfactual_ci_high']:+.3f}]"
        name = folder.name if folder.name not in ("model", "policy") else "/".join(folder.parts[-3:])
        print(f"{name:<52} {cells[0]:>13} {cells[1]:>12} {cells[2]:>9} {shift:>32}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
