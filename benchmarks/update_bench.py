"""Time one on-policy update (policy + KL reference forward) and one collect on fixed batches.

    python benchmarks/update_bench.py --threads 1
    python benchmarks/update_bench.py --threads 2
    git show b891765:learner/prefix.py > /tmp/prefix_old.py   # the shared-header-only version
    python benchmarks/update_bench.py --threads 1 --prefix-module /tmp/prefix_old.py

Batches: ``--reps + 1`` collects of 8 maps x 8 rollouts (window:0, FrozenLake) by the policy
in ``--model``, then ``--reps + 1`` updates (lr 0, so every update sees the same weights) on
the last batch; medians drop the first of each. Pass the final policy of a ``train.py`` run as
``--model`` (its replies are valid and episodes several turns long, as in a real run); the
default, the untrained tiny model, replies invalidly and plays all 8 turns.
OpenMP threads wait as the environment says (torch loads before ``train`` can set its
``OMP_WAIT_POLICY=PASSIVE`` default): set it yourself to compare. Prints one JSON line. A benchmark, not a test: compare numbers of one session, machine quiet.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import numpy as np
import torch



def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="policy folder, e.g. runs/<name>/checkpoints/iter_N/model (default: the embedded tiny model, untrained)")
    ap.add_argument("--ref", default=None, help="KL reference policy folder, e.g. runs/<name>/reference (default: --model)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the update")
    ap.add_argument("--gen-threads", type=int, default=None, help="torch threads of the collect (default --threads)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro-batch", type=int, default=256)
    ap.add_argument("--prefix-module", default=None, help="a .py file whose sampled_logprobs replaces learner.prefix's")
    a = ap.parse_args(argv)

    from agents.policies.policy import Policy
    from agents.rollout.runner import Runner
    from learner.loss import LossSettings
    from learner.prefix import group_prompts, prompt_lengths

    if a.prefix_module:
        spec = importlib.util.spec_from_file_location("prefix_under_test", a.prefix_module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        import learner.prefix

        learner.prefix.sampled_logprobs = mod.sampled_logprobs  # learner.batch looks it up at call time
    from agents.policies.tiny import build_tiny_model

    torch.manual_seed(0)
    model_path = a.model or build_tiny_model("text")
    policy = Policy.from_pretrained(model_path)
    ref = Policy.from_pretrained(a.ref or model_path)
    ref.model.requires_grad_(False)
    from learner.advantages import assign_group_advantages
    from learner.update import policy_update

    runner = Runner(policy, "freshper/FrozenLake-v0", group_size=8, context="window:0", max_new_tokens=8, temperature=1.0, seed=1)
    torch.set_num_threads(a.gen_threads or a.threads)
    t_collect = []
    for k in range(a.reps + 1):
        t = time.perf_counter()
        records, _ = runner.collect(list(range(1000 + 8 * k, 1008 + 8 * k)), policy_version=0)
        t_collect.append(time.perf_counter() - t)
    assign_group_advantages(records)
    good = [r for r in records if not r.failed]
    samples = [s for r in good for s in r.samples if s.num_sampled > 0]
    unique, _ = group_prompts([s.token_ids for s in samples], prompt_lengths(samples))
    optimizer = torch.optim.Adam(policy.model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    torch.set_num_threads(a.threads)
    t_update, st = [], {}
    for _ in range(a.reps + 1):
        t = time.perf_counter()
        st = policy_update(policy, ref, optimizer, scheduler, good, np.ones(len(good)), np.zeros(len(good)),
                           loss_cfg=LossSettings(kl_coef=0.04), micro_batch=a.micro_batch, on_policy=True)
        t_update.append(time.perf_counter() - t)
    print(json.dumps({
        "threads": a.threads, "gen_threads": a.gen_threads or a.threads, "prefix_module": a.prefix_module,
        "samples": len(samples), "distinct_prompts": len(unique), "seq_tokens": st.get("seq_tokens"),
        "sampled_tokens": st.get("tokens"), "collect_s_median": float(np.median(t_collect[1:])),
        "update_s_median": float(np.median(t_update[1:])), "update_s_all": [round(x, 3) for x in t_update],
    }))


if __name__ == "__main__":
    main()
