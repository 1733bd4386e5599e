"""The check that a figure policy needs its picture: the swapped task and the picture-blind ceiling."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import envs
from envs.chartqa import draw_figure
from envs.cli import import_tasks

FIGURES = Path(__file__).resolve().parents[2] / "experiments" / "figures"
KW = {"preset": "grid_value", "image_size": [140, 140], "max_attempts": 1}


def test_the_swapped_task_keeps_the_problem_and_shows_another_problems_picture() -> None:
    import_tasks([str(FIGURES / "swapped_image.py")])
    true, swapped = envs.make("freshper/ChartQA-v0", **KW), envs.make("figures/ChartQASwapped-v0", **KW)
    differ = 0
    try:
        for seed in range(40):
            a, _ = true.reset(seed=seed)
            b, _ = swapped.reset(seed=seed)
            assert a["text"] == b["text"]
            assert true.unwrapped.problem.answer.text() == swapped.unwrapped.problem.answer.text()
            decoy = swapped.unwrapped.decoy
            assert np.array_equal(b["image"], draw_figure(decoy, (140, 140)))
            assert np.array_equal(a["image"], draw_figure(true.unwrapped.problem, (140, 140)))
            differ += not np.array_equal(a["image"], b["image"])
    finally:
        true.close()
        swapped.close()
    assert differ >= 38


def test_the_blind_ceiling_is_the_best_answer_from_the_text_alone() -> None:
    import sys

    sys.path.insert(0, str(FIGURES))
    try:
        from picture_check import blind_ceiling, visible
    finally:
        sys.path.remove(str(FIGURES))
    from envs import chartqa

    held = []
    for seed in range(10_000_000, 10_000_400):
        problem = chartqa.draw_problem(np.random.default_rng(seed), "grid_value")
        held.append({"params": problem.params, "answer": problem.answer.text()})
    ceiling = blind_ceiling("grid_value", held, draws=4000)
    # a value 1-5 of one of 3-4 bars: about one in five, never near what reading gives
    assert 0.15 < ceiling < 0.30
    # the best constant answer over all the problems cannot beat the answer chosen per visible case
    constant = max(np.mean([h["answer"] == str(v) for h in held]) for v in range(1, 6))
    assert ceiling >= constant - 0.05
    # the visible case is what the text tells: the question, the number of bars and the bar asked
    p = held[0]["params"]
    assert visible(p) == ("value", len(p["values"]), p["labels"].index(p["question"]["a"]))
