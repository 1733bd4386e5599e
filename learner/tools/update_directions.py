"""How a run's parameters moved between consecutive checkpoints, and what its policy did meanwhile.

    python train.py --seed 1 --iterations 131 --checkpoint-every 1 --keep-checkpoints 10 --run-name s1
    python -m learner.tools update-directions runs/s1 [--spread]

For every pair of consecutive checkpoints of a run (``--checkpoint-every 1`` makes each one
optimizer step on-policy) it prints the step's size (the L2 norm of the change of all weights),
the cosine between the step and the previous one, and the tensors that moved most. With one
Adam step per iteration, a cosine near 1 says the steps follow Adam's momentum (the average of
the last ~1/(1 - beta1) gradients), not the batch just collected; near 0, each step follows its
own batch. ``--spread`` adds the policy's action spread and counterfactual shift at each
checkpoint (``learner.diagnostics``; the same numbers the periodic evaluations log), so a drift
can be set beside the policy going board-blind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from learner.checkpoint import list_checkpoints


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    files = sorted((ckpt / "model").glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{ckpt / 'model'} has no safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update({k: v for k, v in load_file(f).items() if v.dtype.is_floating_point})
    return out


def steps(ckpts: list[Path]) -> list[dict]:
    """Per consecutive pair: the step's norm, its cosine with the previous step, the top tensors."""
    rows, prev_w, prev_step, prev_norm = [], None, None, 0.0
    for ckpt in ckpts:
        w = weights(ckpt)
        if prev_w is not None:
            delta = {k: (w[k] - prev_w[k]).flatten() for k in w}
            flat = torch.cat([delta[k] for k in sorted(delta)])
            norm = float(flat.norm())
            cos = float(torch.dot(flat, prev_step)) / (norm * prev_norm) if prev_step is not None and norm * prev_norm > 0 else None
            sizes = {k: float(d.norm()) for k, d in delta.items()}
            top = sorted(sizes, key=sizes.get, reverse=True)[:3]
            rows.append({"checkpoint": ckpt.name, "norm": norm, "cos_prev": cos, "top": [(k, sizes[k]) for k in top]})
            prev_step, prev_norm = flat, norm
        prev_w = w
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run folder (its checkpoints/ are read)")
    ap.add_argument("--spread", action="store_true", help="also the action spread and counterfactual shift per checkpoint")
    args = ap.parse_args(argv)
    ckpts = list_checkpoints(Path(args.run) / "checkpoints")
    if len(ckpts) < 2:
        raise SystemExit(f"{args.run} has {len(ckpts)} checkpoint(s); two or more consecutive ones are needed "
                         "(train with --checkpoint-every 1 --keep-checkpoints N)")
    probes = {}
    if args.spread:
        from agents.policies.policy import Policy
        from learner.diagnostics import policy_diagnostics

        cfg = yaml.safe_load((ckpts[0] / "config.yaml").read_text(encoding="utf-8")) or {}
        for ckpt in ckpts:
            probes[ckpt.name] = policy_diagnostics(Policy.from_pretrained(ckpt / "model"), cfg["env_id"],
                                                   cfg.get("env_kwargs"), states=48, probes=32,
                                                   reasoning=cfg.get("reasoning", "none"))
    print(f"{'checkpoint':<12} {'step':>7} {'cos(prev)':>9}  {'spread':>6} {'cf':>6}  largest moves")
    first = probes.get(ckpts[0].name, {})
    if first:
        print(f"{ckpts[0].name:<12} {'':>7} {'':>9}  {first.get('action_spread', float('nan')):6.3f} "
              f"{first.get('counterfactual_shift', float('nan')):+6.3f}")
    for row in steps(ckpts):
        p = probes.get(row["checkpoint"], {})
        cos = "" if row["cos_prev"] is None else f"{row['cos_prev']:+.2f}"
        extra = f"{p['action_spread']:6.3f} {p.get('counterfactual_shift', float('nan')):+6.3f}" if p else f"{'':6} {'':6}"
        top = ", ".join(f"{k.removeprefix('model.')}={v:.4f}" for k, v in row["top"])
        print(f"{row['checkpoint']:<12} {row['norm']:7.4f} {cos:>9}  {extra}  {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
