"""The short-query attention of another revision beside this tree's, in whole real-model updates.

    .venv/bin/python experiments/real_model/attention_fold_ab.py --old 6fcb80f [--model FOLDER] [--repeats 4]

``--old``'s ``agents/policies/attention.py`` (from git) and this tree's take turns as the
registered ``freshper_sdpa`` in one process: SmolLM2-135M-Instruct, 8 Arithmetic problems x 8
samples of up to 16 tokens, bf16 compute over fp32 weights, KL 0.04 against a bf16 copy; the
on-policy update of the 64 records and an update of every fourth of them (a replay batch's
size), alternating. 6fcb80f repeats each key/value head per query head; this tree folds the
query heads into the key/value heads' rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.real_model.update_setup import arithmetic_update  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def old_attention(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:agents/policies/attention.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_attention.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.short_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    from transformers import AttentionInterface

    import agents.policies.attention as attention
    from learner.loss import LossSettings
    from learner.update import policy_update

    policy, ref, records, opt = arithmetic_update(a.model, a.threads)
    impls = {a.old: old_attention(a.old), "this tree": attention.short_attention}

    def update(recs: list) -> float:
        t = time.perf_counter()
        policy_update(policy, ref, opt, None, recs, np.ones(len(recs)), np.zeros(len(recs)),
                      loss_cfg=LossSettings(kl_coef=0.04), on_policy=True)
        return time.perf_counter() - t

    times = {k: {"on-policy": [], "replay-sized": []} for k in impls}
    for name, fn in impls.items():  # warm-up
        AttentionInterface.register(attention.NAME, fn)
        update(records)
    for _ in range(a.repeats):
        for name, fn in impls.items():
            AttentionInterface.register(attention.NAME, fn)
            times[name]["on-policy"].append(update(records))
            times[name]["replay-sized"].append(update(records[::4]))
    base = {part: statistics.median(ts) for part, ts in times[a.old].items()}
    print("| attention | update of 64 s | update of 16 s | vs the old | runs (64; 16) |\n|---|---:|---:|---|---|")
    for name, parts in times.items():
        med = {part: statistics.median(ts) for part, ts in parts.items()}
        runs = "; ".join(" ".join(f"{t:.2f}" for t in ts) for ts in parts.values())
        ratio = ", ".join(f"{med[p] / base[p]:.2f}x" for p in med)
        print(f"| {name} | {med['on-policy']:.2f} | {med['replay-sized']:.2f} | {ratio} | {runs} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    sys.exit(main())
