"""freshper/ChartQA-v0 (envs/chartqa.py): charts of generated data and questions about them.

The answers of 1,000 problems per preset are recomputed here from each chart's data by this
file's own solver, and the text an agent sees is checked to hold no value of the chart.
"""

from __future__ import annotations

import io
import re
import statistics
from fractions import Fraction

import numpy as np
import pytest
from gymnasium.utils import seeding
from gymnasium.utils.env_checker import check_env

import envs
from envs import chartqa
from envs.base import IMAGE_PLACEHOLDER
from envs.play import play

ENV = "freshper/ChartQA-v0"


def solve(p: dict) -> object:
    """The answer from the chart's data, computed independently of envs.chartqa."""
    labels, values, q = p["labels"], p["values"], p["question"]
    table = {label: value for label, value in zip(labels, values)}
    t = q["type"]
    if p.get("grid") and t in ("max", "min"):  # the bar's place from the left
        best = max(values) if t == "max" else min(values)
        return [i + 1 for i, v in enumerate(values) if v == best][0]
    if t == "max":
        return sorted(table, key=table.get)[-1]
    if t == "min":
        return sorted(table, key=table.get)[0]
    if t == "value":
        return table[q["a"]]
    if t == "diff":
        return table[q["a"]] - table[q["b"]]
    if t == "sum":
        return sum(table.values())
    if t == "pair_sum":
        return table[q["a"]] + table[q["b"]]
    if t == "average":
        return statistics.mean(values)
    if t == "count_above":
        return len([v for v in values if v > table[q["a"]]])
    if t == "trend":
        return "rise" if values[-1] - values[0] > 0 else "fall"
    if t == "increases":
        return len([i for i in range(1, len(values)) if values[i] - values[i - 1] > 0])
    if t == "change":
        return values[-1] - values[0]
    raise AssertionError(t)


@pytest.mark.parametrize("preset", sorted(chartqa.PRESETS))
def test_a_thousand_problems_per_preset_are_valid_and_their_answers_recompute(preset: str) -> None:
    spec = chartqa.PRESETS[preset]
    seen = set()
    for seed in range(1000):
        problem = chartqa.draw_problem(np.random.default_rng(seed), preset)
        p = problem.params
        labels, values, q = p["labels"], p["values"], p["question"]
        seen.add((p["chart"], q["type"]))
        assert p["chart"] in spec["charts"] and q["type"] in spec["questions"][p["chart"]]
        assert spec["n"][0] <= len(labels) == len(values) <= spec["n"][1] and len(set(labels)) == len(labels)
        assert values.count(max(values)) == 1 and values.count(min(values)) == 1
        if p["chart"] == "pie":
            assert sum(values) == 100 and min(values) >= 5
        else:
            assert all(1 <= v <= spec["top"] for v in values)
        if p["chart"] == "line":  # consecutive months
            first = chartqa.MONTHS.index(labels[0])
            assert labels == list(chartqa.MONTHS[first:first + len(labels)])
        if q["type"] in ("diff", "pair_sum"):
            assert q["a"] != q["b"] and values[labels.index(q["a"])] > values[labels.index(q["b"])]
        expected = solve(p)
        answer = problem.answer
        if isinstance(expected, str):
            assert answer.value == expected and expected in answer.choices
        elif answer.decimals is None:
            assert isinstance(answer.value, Fraction) and answer.value == expected, (seed, p)
        else:
            assert q["type"] == "average" and abs(answer.value - float(expected)) < 1e-9
            assert "to one decimal place" in problem.ask
        # the chart is the only place the data is
        assert not re.search(r"\d", problem.question), problem.question
        assert set(problem.given) == set(values)
        if p.get("grid"):
            assert problem.statement == f"The bars from left to right are {' '.join(map(str, values))} squares high."
        else:
            for label, value in zip(labels, values):
                assert f"{label} {value}" in problem.statement
    # every chart and question of the preset comes up
    assert seen == {(c, t) for c in spec["charts"] for t in spec["questions"][c]}


def test_check_env_passes() -> None:
    for mode in ("rgb_array", "ansi"):
        check_env(envs.make(ENV, render_mode=mode).unwrapped)
    for preset in ("medium", "hard"):
        check_env(envs.make(ENV, preset=preset).unwrapped)
    check_env(envs.make(ENV, preset="grid", image_size=[140, 140]).unwrapped)


def read_grid(image: np.ndarray, n: int, square: int = 28) -> list[int]:
    """A grid chart's values read off its pixels: the coloured squares above each bar's slot,
    counted by the colour at each square's centre (the first column is the axis)."""
    h = image.shape[0]
    values = []
    for i in range(n):
        x = (i + 1) * square + square // 2
        column = [image[h - r * square - square // 2, x] for r in range(h // square)]
        filled = [int(c.min()) < 225 for c in column]  # a bar's square, not the white background
        count = filled.index(False) if False in filled else len(filled)
        assert not any(filled[count:]), "a bar's squares are contiguous from the bottom"
        values.append(count)
    return values


def test_grid_charts_draw_one_square_per_unit_on_the_visual_tokens() -> None:
    """The grid preset: each bar is one 28-pixel square wide and as many high as its value, in
    the picture's bottom-left corner (so every square is one visual token at 140 x 140), in its
    category's colour wherever it stands, and the text names the categories from left to right
    and holds no value."""
    env = envs.make(ENV, preset="grid", image_size=[140, 140])
    for seed in range(200):
        obs, info = env.reset(seed=seed)
        p = info["problem"]["params"]
        assert p["grid"] is True and obs["image"].shape == (140, 140, 3)
        assert read_grid(obs["image"], len(p["values"])) == p["values"], (seed, p)
        assert f"from left to right {', '.join(p['labels'])};" in obs["text"]
        assert not re.search(r"\d", obs["text"])
    # a category's bar has its colour wherever it stands
    fig_first = {"chart": "bar", "labels": ["fig", "kiwi", "lime"], "values": [2, 3, 1], "question": {"type": "max"},
                 "grid": True}
    fig_last = {**fig_first, "labels": ["kiwi", "lime", "fig"], "values": [3, 1, 2]}
    a = env.reset(options={"problem": {"kind": "bar", "params": fig_first}})[0]["image"]
    b = env.reset(options={"problem": {"kind": "bar", "params": fig_last}})[0]["image"]
    assert np.array_equal(a[:, 28:56], b[:, 84:112])
    # the same chart at another size: squares shrink to fit, the bars still read
    small = envs.make(ENV, preset="grid", image_size=[112, 112])
    obs, info = small.reset(seed=1)
    p = info["problem"]["params"]
    cell = min(112 // (len(p["values"]) + 1), 112 // 5)
    assert read_grid(obs["image"], len(p["values"]), cell) == p["values"]
    # out-of-range grid charts are refused
    bad = {"chart": "bar", "labels": ["apple", "fig", "kiwi"], "values": [2, 13, 1], "question": {"type": "max"}, "grid": True}
    with pytest.raises(ValueError, match="grid chart"):
        env.reset(options={"problem": {"kind": "bar", "params": bad}})
    with pytest.raises(ValueError, match="grid must be"):
        env.reset(options={"problem": {"kind": "bar", "params": {**bad, "values": [2, 3, 1], "grid": "yes"}}})


@pytest.mark.parametrize("preset", sorted(chartqa.PRESETS))
def test_the_text_holds_no_value_of_the_chart(preset: str) -> None:
    env = envs.make(ENV, preset=preset, image_size=[336, 252])
    for seed in range(20):
        obs, info = env.reset(seed=seed)
        assert obs["text"].count(IMAGE_PLACEHOLDER) == 1
        assert not re.search(r"\d", obs["text"]), obs["text"]
        assert obs["image"].shape == (252, 336, 3) and obs["image"].dtype == np.uint8
        obs, *_ = env.step("<answer>zzz</answer>")  # a wrong answer's feedback names no value either
        assert not re.search(r"\d", obs["text"].split("Turns left")[0]), obs["text"]
        assert not re.search(r"\d", env.unwrapped.state_text())


def test_the_picture_carries_the_data() -> None:
    """One value changed changes the picture and not the text; each chart kind draws."""
    env = envs.make(ENV)
    base = {"chart": "bar", "labels": ["apple", "pear", "fig"], "values": [3, 9, 5], "question": {"type": "max"}}
    a, _ = env.reset(options={"problem": {"kind": "bar", "params": base}})
    b, _ = env.reset(options={"problem": {"kind": "bar", "params": {**base, "values": [3, 9, 6]}}})
    assert a["text"] == b["text"] and not np.array_equal(a["image"], b["image"])
    line = {"chart": "line", "labels": ["Jan", "Feb", "Mar"], "values": [4, 8, 6], "question": {"type": "trend"}}
    pie = {"chart": "pie", "labels": ["apple", "pear", "fig"], "values": [50, 30, 20], "question": {"type": "min"}}
    images = [env.reset(options={"problem": {"kind": k["chart"], "params": k}})[0]["image"] for k in (line, pie)]
    for image in [a["image"], *images]:
        assert (image < 128).any() and (image > 250).mean() > 0.3
    assert not np.array_equal(images[0], images[1])


def test_resets_are_deterministic_by_seed() -> None:
    env, again = envs.make(ENV, preset="hard"), envs.make(ENV, preset="hard")
    seen = set()
    for seed in (0, 3, 1_900_000_000, 1_900_000_001):
        obs, info = env.reset(seed=seed)
        obs2, info2 = again.reset(seed=seed)
        assert obs["text"] == obs2["text"] and np.array_equal(obs["image"], obs2["image"])
        assert info["problem"] == info2["problem"] == chartqa.draw_problem(seeding.np_random(seed)[0], "hard").to_dict()
        seen.add(str(info["problem"]))
    assert len(seen) == 4


def _env(params: dict, **kwargs):
    env = envs.make(ENV, **kwargs)
    env.reset(seed=0, options={"problem": {"kind": params["chart"], "params": params}})
    return env


BAR = {"chart": "bar", "labels": ["apple", "pear", "fig", "kiwi"], "values": [12, 30, 7, 19]}


@pytest.mark.parametrize("question, reply, correct", [
    ({"type": "max"}, "pear", True), ({"type": "max"}, " Pear. ", True), ({"type": "max"}, "kiwi", False),
    ({"type": "min"}, "fig", True), ({"type": "value", "a": "kiwi"}, "19", True),
    ({"type": "value", "a": "kiwi"}, "19.0", True), ({"type": "value", "a": "kiwi"}, "18", False),
    ({"type": "diff", "a": "pear", "b": "apple"}, "18", True), ({"type": "diff", "a": "pear", "b": "apple"}, "-18", False),
    ({"type": "sum"}, "68", True), ({"type": "average"}, "17", True), ({"type": "average"}, "17.04", True),
    ({"type": "average"}, "17.1", False), ({"type": "count_above", "a": "apple"}, "2", True),
    ({"type": "pair_sum", "a": "kiwi", "b": "fig"}, "26", True),
])
def test_answer_checking(question: dict, reply: str, correct: bool) -> None:
    env = _env({**BAR, "question": question}, max_attempts=1)
    _, reward, terminated, _, info = env.step(f"<answer>{reply}</answer>")
    assert info["action_is_valid"] and info["success"] is correct and terminated
    assert reward == (1.0 if correct else 0.0)


def test_line_chart_questions() -> None:
    line = {"chart": "line", "labels": ["Mar", "Apr", "May", "Jun"], "values": [20, 14, 25, 31]}
    for question, gold in (({"type": "trend"}, "rise"), ({"type": "increases"}, "2"), ({"type": "change"}, "11")):
        env = _env({**line, "question": question}, max_attempts=1)
        assert env.unwrapped.problem.answer.text() == gold
        assert env.step(f"<answer>{gold}</answer>")[4]["success"]
    env = _env({**line, "values": [20, 14, 25, 9], "question": {"type": "change"}}, max_attempts=1)
    assert env.step("<answer>-11</answer>")[4]["success"]
    env = _env({**line, "question": {"type": "trend"}})
    obs, *_ = env.step("<answer>up</answer>")  # rise or fall only
    assert "not one of the names" in obs["text"]


@pytest.mark.parametrize("reply", ["pear", "<answer></answer>", "<answer>" + "p" * 70 + "</answer>"])
def test_replies_without_an_answer_are_invalid_and_cost_no_attempt(reply: str) -> None:
    env = _env({**BAR, "question": {"type": "max"}})
    obs, reward, terminated, _, info = env.step(reply)
    assert not info["action_is_valid"] and reward == pytest.approx(-0.1) and not terminated and info["attempts"] == 0


@pytest.mark.parametrize("question, answer, why", [
    ({"type": "max"}, "banana", "not one of the names"), ({"type": "max"}, "30", "not one of the names"),
    ({"type": "value", "a": "pear"}, "thirty", "not a number"), ({"type": "value", "a": "pear"}, "pear", "not a number"),
    ({"type": "value", "a": "pear"}, "3 0", "not a number"), ({"type": "value", "a": "pear"}, "2**5", "not a number"),
    ({"type": "value", "a": "pear"}, "__import__('os')", "not a number"),
])
def test_malformed_answers_spend_an_attempt_and_say_why(question: dict, answer: str, why: str) -> None:
    env = _env({**BAR, "question": question})
    obs, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
    assert info["action_is_valid"] and not info["success"] and reward == 0.0 and info["attempts"] == 1
    assert why in obs["text"] and "try again (one attempt left)" in obs["text"]


def test_bad_problems_are_refused() -> None:
    env = envs.make(ENV)
    for params in ({**BAR, "question": {"type": "value", "a": "banana"}},
                   {**BAR, "values": [30, 30, 7, 19], "question": {"type": "max"}},
                   {**BAR, "question": {"type": "trend"}},
                   {"chart": "pie", "labels": ["a", "b"], "values": [50, 40], "question": {"type": "max"}},
                   {**BAR, "question": {"type": "median"}}):
        with pytest.raises(ValueError):
            env.reset(options={"problem": {"kind": params["chart"], "params": params}})


def test_attempts_with_feedback() -> None:
    env = _env({**BAR, "question": {"type": "max"}})
    obs, reward, terminated, _, info = env.step("<answer>kiwi</answer>")
    assert (reward, terminated) == (0.0, False)
    assert "'kiwi' is not correct; try again (one attempt left)" in obs["text"] and "Attempts left: one." in obs["text"]
    obs, reward, terminated, _, info = env.step("<answer>pear</answer>")
    assert (reward, terminated, info["success"], info["attempts"]) == (1.0, True, True, 2)
    env = _env({**BAR, "question": {"type": "max"}})
    env.step("<answer>kiwi</answer>")
    *_, terminated, _, info = env.step("<answer>fig</answer>")
    assert terminated and not info["success"] and info["gold_answer"] == "pear"


def test_random_replies_are_well_formed() -> None:
    env = envs.make(ENV, preset="hard")
    rng = np.random.default_rng(1)
    for seed in range(40):
        env.reset(seed=seed)
        for _ in range(3):
            assert env.unwrapped.parse_action(env.unwrapped.sample_reply(rng))[1] is None


def test_human_play_in_the_terminal() -> None:
    env = envs.make(ENV)
    env.reset(seed=11)
    gold = env.unwrapped.problem.answer.text()
    out = io.StringIO()
    summary = play(ENV, seed=11, stdin=io.StringIO(f"{gold}\n"), stdout=out)
    assert summary.success and summary.turns == 1
    assert env.unwrapped.problem.statement in out.getvalue()  # the chart's data in words, for a terminal


def test_another_problems_picture_keeps_the_text_and_answer_and_shows_the_next_draw() -> None:
    from envs.capabilities import other_picture_kwargs
    from envs.geometry import GeometryEnv, GeometryVisionEnv

    kw = {"preset": "grid_value", "image_size": [140, 140]}
    own = envs.make(ENV, **kw)
    other = envs.make(ENV, **kw, **other_picture_kwargs(chartqa.ChartQAEnv))
    shown_values = []
    for seed in range(30):
        a, _ = own.reset(seed=seed)
        b, _ = other.reset(seed=seed)
        problem, decoy = other.unwrapped.problem, other.unwrapped.decoy
        assert a["text"] == b["text"] and problem.to_dict() == own.unwrapped.problem.to_dict()
        # the decoy is the preset's next draw from the episode's RNG: the problem after the episode's own
        rng = seeding.np_random(seed)[0]
        chartqa.draw_problem(rng, "grid_value")
        assert decoy.to_dict() == chartqa.draw_problem(rng, "grid_value").to_dict()
        assert np.array_equal(b["image"], chartqa.draw_figure(decoy, (140, 140)))
        shown_values.append(tuple(decoy.params["values"]) != tuple(problem.params["values"]))
        # an answer is still checked against the episode's own problem
        _, reward, *_ = other.step(f"<answer>{problem.answer.text()}</answer>")
        assert reward == 1.0
    assert sum(shown_values) >= 28
    check_env(envs.make(ENV, **kw, picture="another").unwrapped)
    assert other_picture_kwargs(GeometryVisionEnv) == {"picture": "another"} and other_picture_kwargs(GeometryEnv) == {}
    with pytest.raises(ValueError, match="vision tasks only"):
        envs.make("freshper/Geometry-v0", picture="another")
    with pytest.raises(ValueError, match="picture must be one of"):
        envs.make(ENV, picture="mine")
