"""The KL reference kept on the records: one real-model update with and without it, alternating.

    .venv/bin/python experiments/real_model/reference_ab.py [--model FOLDER] [--repeats 4]

SmolLM2-135M-Instruct (``--model``: a model folder, default the converted package's), 8
Arithmetic problems x 8 samples of up to 16 tokens, bf16 compute over fp32 weights, KL 0.04
against a bf16 copy of the start: the on-policy update of fresh copies of the records, then a
replay update of every fourth of them, with ``keep_reference_logprobs`` on (the learner's
setting: the on-policy update keeps the reference's log-probs, the replay update reads them) and
off (both run the reference). Medians and every repeat are printed.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.real_model.update_setup import arithmetic_update  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    from learner.loss import LossSettings
    from learner.update import policy_update

    policy, ref, records, opt = arithmetic_update(a.model, a.threads)

    def update(keep: bool, on_policy: bool, recs: list) -> float:
        t = time.perf_counter()
        policy_update(policy, ref, opt, None, recs, np.ones(len(recs)), np.zeros(len(recs)),
                      loss_cfg=LossSettings(kl_coef=0.04), on_policy=on_policy, keep_reference_logprobs=keep)
        return time.perf_counter() - t

    update(False, True, copy.deepcopy(records))  # warm-up
    times: dict[bool, dict[str, list[float]]] = {k: {"on-policy": [], "replay": []} for k in (False, True)}
    for _ in range(a.repeats):
        for keep in (False, True):
            recs = copy.deepcopy(records)
            times[keep]["on-policy"].append(update(keep, True, recs))
            times[keep]["replay"].append(update(keep, False, recs[::4]))
    print(f"{len(records)} records, replay updates of {len(records[::4])}")
    print("| reference | on-policy update s | replay update s | runs (on-policy; replay) |\n|---|---:|---:|---|")
    for keep, parts in times.items():
        runs = "; ".join(" ".join(f"{t:.2f}" for t in ts) for ts in parts.values())
        print(f"| {'kept on the records' if keep else 'run every update'} | {statistics.median(parts['on-policy']):.2f} | "
              f"{statistics.median(parts['replay']):.2f} | {runs} |")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
