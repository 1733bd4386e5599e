"""Does a policy read the chart? Held-out success with the true picture and with another problem's.

    python experiments/figures/picture_check.py start=.cache/freshper/pretrained-ChartQA-v0-s0-<key> \\
        delivered=runs/<run>/best/iter_000600/model --json docs/data/figures/grid_value/picture_check_s0.json \\
        --kw preset=grid_value "image_size=[140,140]" max_attempts=1

Each ``label=MODEL`` is evaluated (``agents.evaluate.evaluate``, sampled, the held-out seeds a
run's start and final evaluations use) on ``freshper/ChartQA-v0`` as it is and with
``picture="another"`` (the same problems and text, another problem's picture; what
``swapped_image.py`` registers and a run's own evaluations play). It also prints the
picture-blind ceiling: the success of the best answer that depends only on what the text tells (the number of bars, which bar is asked, the question), the
most frequent answer for each, estimated on 20,000 training-seed problems of the preset and
scored on the same held-out problems. A policy that reads the chart falls to that ceiling or
below with another picture; one that does not keeps its success. With the true picture, success
is also split by the bar the question asks (its place from the left, where the question names one).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np


def visible(params: dict) -> tuple:
    """What the text of a chart question tells about its answer: the question, the number of
    bars, and which bar it names (its place)."""
    q = params["question"]
    place = params["labels"].index(q["a"]) if "a" in q else -1
    return q["type"], len(params["values"]), place


def blind_ceiling(preset: str, held_out: list[dict], draws: int = 20_000) -> float:
    """The success on ``held_out`` problems (their params) of answering, for each thing the text
    tells, the answer most frequent among ``draws`` problems of ``preset`` from other seeds."""
    from envs import chartqa

    counts: dict[tuple, Counter] = defaultdict(Counter)
    for seed in range(draws):
        problem = chartqa.draw_problem(np.random.default_rng(seed), preset)
        counts[visible(problem.params)][problem.answer.text()] += 1
    best = {key: c.most_common(1)[0][0] for key, c in counts.items()}
    right = [best.get(visible(p["params"])) == p["answer"] for p in held_out]
    return float(np.mean(right))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", metavar="LABEL=MODEL")
    parser.add_argument("--kw", nargs="*", default=[], metavar="KEY=VALUE",
                        help="the task's keyword arguments, as agents.evaluate takes them")
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw each policy's two successes with their intervals and the blind ceiling")
    args = parser.parse_args()

    import envs
    from agents.evaluate import evaluate
    from agents.policies.policy import Policy
    from agents.rollout.seeds import EVAL_SEED_BASE
    from envs.capabilities import other_picture_kwargs
    from envs.chartqa import ChartQAEnv
    from envs.play import parse_kwargs

    kwargs = parse_kwargs(args.kw)
    env = envs.make("freshper/ChartQA-v0", **kwargs)
    held = []
    try:
        for seed in range(EVAL_SEED_BASE, EVAL_SEED_BASE + args.episodes):
            env.reset(seed=seed)
            problem = env.unwrapped.problem
            held.append({"params": problem.params, "answer": problem.answer.text(), "seed": seed})
    finally:
        env.close()
    place_of = {h["seed"]: visible(h["params"])[2] for h in held}
    ceiling = blind_ceiling(kwargs.get("preset", "easy"), held)
    rows = []
    print(f"{'policy':<12} {'true picture':>24} {'another picture':>24}   (picture-blind ceiling {ceiling:.3f})")
    for item in args.models:
        label, _, path = item.partition("=")
        policy = Policy.from_pretrained(path)
        row = {"label": label, "model": path}
        for name, task_kwargs in (("true", kwargs), ("swapped", {**kwargs, **other_picture_kwargs(ChartQAEnv)})):
            result = evaluate(policy, "freshper/ChartQA-v0", episodes=args.episodes, env_kwargs=task_kwargs,
                              max_new_tokens=args.max_new_tokens)
            by_place: dict[int, list[bool]] = defaultdict(list)
            for record in result.records:
                by_place[place_of[record.seed]].append(bool(record.success))
            row[name] = {"success": result.success_rate, "ci": list(result.success_ci),
                         "by_place": {str(k + 1): float(np.mean(v)) for k, v in sorted(by_place.items()) if k >= 0}}
        rows.append(row)
        cell = {k: f"{row[k]['success']:.3f} [{row[k]['ci'][0]:.3f}, {row[k]['ci'][1]:.3f}]" for k in ("true", "swapped")}
        places = " ".join(f"{k}:{v:.2f}" for k, v in row["true"]["by_place"].items())
        print(f"{label:<12} {cell['true']:>24} {cell['swapped']:>24}   by the bar asked: {places}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"task_kwargs": kwargs, "episodes": args.episodes,
                                               "blind_ceiling": ceiling, "rows": rows}, indent=1), encoding="utf-8")
    if args.plot:
        plot(rows, ceiling, args.episodes, Path(args.plot))
    return 0


def plot(rows: list[dict], ceiling: float, episodes: int, out: Path) -> None:
    """Grouped bars: each policy's held-out success with the true picture and with another
    problem's, 95% intervals, and the picture-blind ceiling as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4))
    x = np.arange(len(rows))
    for k, (name, colour, label) in enumerate((("true", "C0", "the chart's own picture"),
                                               ("swapped", "C3", "another problem's picture"))):
        values = [r[name]["success"] for r in rows]
        err = [[v - r[name]["ci"][0] for v, r in zip(values, rows)], [r[name]["ci"][1] - v for v, r in zip(values, rows)]]
        ax.bar(x + (k - 0.5) * 0.38, values, 0.38, yerr=err, capsize=3, color=colour, label=label)
    ax.axhline(ceiling, ls="--", color="0.3", label=f"picture-blind ceiling ({ceiling:.2f})")
    ax.set_xticks(x, [r["label"] for r in rows], rotation=30, ha="right")
    ax.set_ylim(0, 1.22)
    ax.set_ylabel(f"held-out success ({episodes} charts, 95% CI)")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
