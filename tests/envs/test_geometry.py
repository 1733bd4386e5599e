"""freshper/GeometryVision-v0 and its text twin freshper/Geometry-v0 (envs/geometry.py).

The answers of 1,000 problems per preset are recomputed here from each problem's parameters
by a solver of this file's own, on coordinates (the task's solver uses formulas), so a wrong
formula or a wrong parameter in either is caught.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest
from gymnasium.utils import seeding
from gymnasium.utils.env_checker import check_env

import envs
from envs import geometry
from envs.base import IMAGE_PLACEHOLDER
from envs.play import play

SEEDS = range(1000)
VISION, TEXT = "freshper/GeometryVision-v0", "freshper/Geometry-v0"


# -- an independent solver: coordinates and vectors ---------------------------------------------------
def _angle(vertex, p, q) -> float:
    """The angle p-vertex-q in degrees, from the vectors."""
    u = np.subtract(p, vertex)
    v = np.subtract(q, vertex)
    return math.degrees(math.acos(np.clip(np.dot(u, v) / (np.linalg.norm(u) * np.linalg.norm(v)), -1, 1)))


def _shoelace(*points) -> float:
    return abs(sum(x0 * y1 - x1 * y0 for (x0, y0), (x1, y1) in zip(points, points[1:] + points[:1]))) / 2


def solve(kind: str, p: dict) -> float:
    if kind == "triangle_angle":
        # build the triangle from A, B and the base, measure the angle at C
        ra, rb = math.radians(p["A"]), math.radians(p["B"])
        # C is where the rays from A (angle A) and from B=(1,0) (angle 180-B) meet
        t = math.sin(rb) / math.sin(ra + rb)
        C = (t * math.cos(ra), t * math.sin(ra))
        return _angle(C, (0, 0), (1, 0))
    if kind == "triangle_perimeter":
        return p["a"] + p["b"] + p["c"]
    if kind == "rectangle":
        corners = [(0, 0), (p["w"], 0), (p["w"], p["h"]), (0, p["h"])]
        if p["ask"] == "area":
            return _shoelace(*corners)
        return sum(math.dist(a, b) for a, b in zip(corners, corners[1:] + corners[:1]))
    if kind == "parallel_lines":
        t = math.radians(p["theta"])
        up, down = (math.cos(t), math.sin(t)), (-math.cos(t), -math.sin(t))
        rays = {"UR": (up, (1, 0)), "UL": (up, (-1, 0)), "LL": (down, (-1, 0)), "LR": (down, (1, 0))}
        # the same angles at both crossings: the lines are parallel
        u, v = rays[p["asked"][1]]
        return _angle((0, 0), u, v)
    if kind == "right_triangle":
        if p["ask"] == "c":
            return math.dist((p["a"], 0), (0, p["b"]))
        return math.sqrt(p["c"] ** 2 - p["a"] ** 2)
    if kind == "triangle_area":
        A, B, C = (0, 0), (p["base"], 0), (p["foot"] * p["base"], p["height"])
        return _shoelace(A, B, C)
    if kind == "inscribed_angle":
        h = math.radians(p["central"] / 2)
        A, B, O = (-math.sin(h), -math.cos(h)), (math.sin(h), -math.cos(h)), (0, 0)
        C = (0.3, math.sqrt(1 - 0.09))  # any point of the major arc
        return _angle(C, A, B) if p["ask"] == "inscribed" else _angle(O, A, B)
    if kind == "circle_chord":
        # the chord is the line y = -d across the circle x^2 + y^2 = r^2
        xs = np.roots([1, 0, p["d"] ** 2 - p["r"] ** 2])
        return float(abs(xs[0] - xs[1]))
    if kind == "circle_tangent":
        # T: the point of the circle where OT is perpendicular to PT (Thales over OP)
        r, d = p["r"], p["d"]
        x = r * r / d
        T = (x, math.sqrt(r * r - x * x))
        return math.dist(T, (d, 0))
    if kind == "law_of_cosines":
        C, B = (0, 0), (p["a"], 0)
        A = (p["b"] * math.cos(math.radians(p["C"])), p["b"] * math.sin(math.radians(p["C"])))
        return math.dist(A, B)
    if kind == "circle_measure":
        return math.pi * p["r"] ** 2 if p["ask"] == "area" else 2 * math.pi * p["r"]
    raise AssertionError(kind)


def _given(kind: str, p: dict) -> set[float]:
    """The values written on the figure, from the parameters."""
    if kind == "parallel_lines":
        return {p["theta"] if p["given"][1] in ("UR", "LL") else 180 - p["theta"]}
    if kind == "inscribed_angle":
        return {p["central"] if p["ask"] == "inscribed" else p["central"] // 2}
    if kind == "triangle_area":
        return {p["base"], p["height"]}
    keys = {"triangle_angle": "AB", "triangle_perimeter": "abc", "rectangle": ("w", "h"),
            "right_triangle": [k for k in "abc" if k in p], "circle_chord": "rd", "circle_tangent": "rd",
            "law_of_cosines": "abC", "circle_measure": "r"}[kind]
    return {p[k] for k in keys}


def _valid(kind: str, p: dict) -> None:
    if kind in ("triangle_angle",):
        assert p["A"] >= 25 and p["B"] >= 25 and 180 - p["A"] - p["B"] >= 30
    if kind == "triangle_perimeter":
        a, b, c = p["a"], p["b"], p["c"]
        assert a + b > c and b + c > a and a + c > b
    if kind == "parallel_lines":
        assert p["given"] != p["asked"] and not 80 < p["theta"] < 100  # theta and 180 - theta differ
    if kind == "right_triangle" and p["ask"] == "b":
        assert p["c"] > p["a"]
    if kind == "triangle_area":
        assert 0 < p["foot"] < 1
    if kind == "inscribed_angle":
        assert p["central"] % 2 == 0 and 0 < p["central"] < 180
    if kind == "circle_chord":
        assert 0 < p["d"] < p["r"]
    if kind == "circle_tangent":
        assert p["d"] > p["r"] > 0


@pytest.mark.parametrize("preset", sorted(geometry.PRESETS))
def test_a_thousand_problems_per_preset_are_valid_and_their_answers_recompute(preset: str) -> None:
    kinds = set()
    for seed in SEEDS:
        problem = geometry.draw_problem(np.random.default_rng(seed), preset)
        kind, p = problem.kind, problem.params
        kinds.add(kind)
        _valid(kind, p)
        expected = solve(kind, p)
        answer = problem.answer
        if answer.decimals is None:  # exact: a whole number or a fraction, equal to the recomputed one
            assert isinstance(answer.value, Fraction)
            assert abs(float(answer.value) - expected) < 1e-6, (seed, kind, p)
            if kind != "triangle_area":
                assert answer.value.denominator == 1
            assert "decimal" not in problem.ask
        else:
            assert answer.decimals == 1 and "to one decimal place" in problem.ask
            assert abs(float(answer.value) - expected) < 1e-9, (seed, kind, p)
            if kind in ("right_triangle", "circle_chord", "circle_tangent"):  # a root: exact where it is whole
                assert abs(expected - round(expected)) > 1e-9
        assert float(answer.value) > 0
        given = _given(kind, p)
        assert set(problem.given) == given
        # the text twin states every given value; the vision question holds no digit at all
        for value in given:
            assert re.search(rf"(?<!\d){re.escape(geometry.fmt(value))}(?!\d)", problem.statement), (kind, value)
        assert not re.search(r"\d", problem.question), problem.question
    assert kinds == {k for k, _ in geometry.PRESETS[preset]}


def test_every_kind_is_in_some_preset_and_the_exact_presets_are_exact() -> None:
    assert {k for pairs in geometry.PRESETS.values() for k, _ in pairs} == set(geometry.KINDS)
    for preset in ("easy", "medium"):
        for seed in range(200):
            assert geometry.draw_problem(np.random.default_rng(seed), preset).answer.decimals is None


@pytest.mark.parametrize("env_id", [VISION, TEXT])
def test_check_env_passes(env_id: str) -> None:
    for mode in ("rgb_array", "ansi"):
        check_env(envs.make(env_id, render_mode=mode).unwrapped)


def test_the_vision_text_holds_no_given_value_and_the_twin_holds_them_all() -> None:
    vision, text = envs.make(VISION, preset="mixed"), envs.make(TEXT, preset="mixed")
    for seed in range(40):
        obs, info = vision.reset(seed=seed)
        twin, _ = text.reset(seed=seed)
        problem = vision.unwrapped.problem
        assert problem.to_dict() == text.unwrapped.problem.to_dict() == info["problem"]
        assert obs["text"].count(IMAGE_PLACEHOLDER) == 1 and IMAGE_PLACEHOLDER not in twin["text"]
        assert not re.search(r"\d", obs["text"]), obs["text"]  # no value, and no digit at all
        for value in problem.given:
            assert geometry.fmt(value) in twin["text"]
        # a wrong answer's feedback keeps the state's text free of values too
        obs, *_ = vision.step("<answer>0.5</answer>")
        assert not re.search(r"\d", vision.unwrapped.state_text())


def test_the_picture_carries_the_values() -> None:
    """Changing one given value changes the picture (its numbers are drawn on it), and only the
    picture: the vision text stays the same."""
    env = envs.make(VISION)
    a, _ = env.reset(options={"problem": {"kind": "triangle_perimeter", "params": {"a": 7, "b": 8, "c": 9}}})
    b, _ = env.reset(options={"problem": {"kind": "triangle_perimeter", "params": {"a": 7, "b": 8, "c": 6}}})
    c, _ = env.reset(options={"problem": {"kind": "triangle_angle", "params": {"A": 50, "B": 60}}})
    d, _ = env.reset(options={"problem": {"kind": "triangle_angle", "params": {"A": 50, "B": 61}}})
    assert a["text"] == b["text"] and c["text"] == d["text"]
    assert not np.array_equal(a["image"], b["image"]) and not np.array_equal(c["image"], d["image"])
    for obs in (a, b, c, d):
        assert obs["image"].shape == (252, 252, 3) and obs["image"].dtype == np.uint8
        assert (obs["image"] < 128).any() and (obs["image"] > 250).mean() > 0.5  # dark ink on white


def test_resets_are_deterministic_by_seed() -> None:
    env, again = envs.make(VISION, preset="mixed"), envs.make(VISION, preset="mixed")
    problems = []
    for seed in (0, 1, 7, 1_900_000_000):
        obs, info = env.reset(seed=seed)
        obs2, info2 = again.reset(seed=seed)
        assert obs["text"] == obs2["text"] and np.array_equal(obs["image"], obs2["image"])
        assert info["problem"] == info2["problem"]
        # the problem is the module's draw from gymnasium's seeding of that seed
        assert info["problem"] == geometry.draw_problem(seeding.np_random(seed)[0], "mixed").to_dict()
        problems.append(str(info["problem"]))
    assert len(set(problems)) == len(problems)
    held_out = {str(geometry.draw_problem(seeding.np_random(1_900_000_000 + k)[0], "mixed").to_dict())
                for k in range(50)}
    assert len(held_out) > 45  # held-out seeds give varied problems


def _env_with(kind: str, params: dict, env_id: str = VISION, **kwargs):
    env = envs.make(env_id, **kwargs)
    env.reset(seed=0, options={"problem": {"kind": kind, "params": params}})
    return env


@pytest.mark.parametrize("reply, correct", [
    ("<answer>48</answer>", True), ("<answer> 48 </answer>", True), ("<answer>48.0</answer>", True),
    ("<answer>96/2</answer>", True), ("<answer>48 units</answer>", True), ("I add them: <answer>48</answer>", True),
    ("<answer>47</answer>", False), ("<answer>48.01</answer>", False), ("<answer>-48</answer>", False),
])
def test_exact_answers(reply: str, correct: bool) -> None:
    env = _env_with("triangle_perimeter", {"a": 12, "b": 16, "c": 20})
    _, reward, terminated, _, info = env.step(reply)
    assert info["action_is_valid"] and info["success"] is correct and reward == (1.0 if correct else 0.0)
    assert terminated is correct


def test_fraction_answers_and_units() -> None:
    env = _env_with("triangle_area", {"base": 7, "height": 5, "foot": 0.5})
    assert env.step("<answer>35/2</answer>")[4]["success"]
    env = _env_with("triangle_area", {"base": 7, "height": 5, "foot": 0.5})
    assert env.step("<answer>17.5</answer>")[4]["success"]
    env = _env_with("triangle_angle", {"A": 50, "B": 60})
    assert env.step("<answer>70°</answer>")[4]["success"]


@pytest.mark.parametrize("answer, correct", [("10.6", True), ("10.58", True), ("10.53", True), ("10.62", True),
                                             ("10.52", False), ("10.63", False), ("10.5", False), ("10.7", False),
                                             ("11", False)])
def test_answers_to_one_decimal_place_are_within_half_a_unit(answer: str, correct: bool) -> None:
    # sqrt(6^2 + 11^2 - 2*6*11*cos 70) = 10.5761: within 0.05 is [10.5261, 10.6261]
    env = _env_with("law_of_cosines", {"a": 6, "b": 11, "C": 70}, max_attempts=1)
    assert env.unwrapped.problem.answer.text() == "10.6"
    _, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
    assert info["success"] is correct and terminated


@pytest.mark.parametrize("reply", ["no tag here", "<answer></answer>", "<answer>   </answer>", "48",
                                   "<answer>" + "9" * 80 + "</answer>"])
def test_replies_without_an_answer_are_invalid_and_cost_no_attempt(reply: str) -> None:
    env = _env_with("triangle_perimeter", {"a": 12, "b": 16, "c": 20})
    before = env.unwrapped.state_text()
    obs, reward, terminated, truncated, info = env.step(reply)
    assert not info["action_is_valid"] and reward == pytest.approx(-0.1) and not terminated
    assert info["attempts"] == 0 and env.unwrapped.state_text() == before
    assert obs["text"].startswith("Invalid reply:")


@pytest.mark.parametrize("answer", ["forty-eight", "__import__('os').system('touch /tmp/pwned')", "6*8", "2**5 + 16",
                                    "1/0", "4 8", "48 48", "0x30", "4.8e1", "nan", "inf"])
def test_malformed_answers_are_read_as_data_and_are_not_correct(answer: str, tmp_path, monkeypatch) -> None:
    """An answer that is not a number is never evaluated: it spends an attempt, is not correct,
    and the feedback says it is not a number."""
    monkeypatch.chdir(tmp_path)
    env = _env_with("triangle_perimeter", {"a": 12, "b": 16, "c": 20})
    obs, reward, terminated, _, info = env.step(f"<answer>{answer}</answer>")
    assert info["action_is_valid"] and not info["success"] and reward == 0.0 and info["attempts"] == 1
    assert "is not a number" in obs["text"] and "try again (two attempts left)" in obs["text"]
    assert not list(tmp_path.iterdir()) and not (tmp_path / "pwned").exists()


def test_attempts_with_feedback() -> None:
    env = _env_with("triangle_perimeter", {"a": 12, "b": 16, "c": 20})
    obs, reward, terminated, _, info = env.step("<answer>40</answer>")
    assert (reward, terminated, info["attempts"]) == (0.0, False, 1)
    assert "'40' is not correct; try again (two attempts left)" in obs["text"] and "Attempts left: two." in obs["text"]
    obs, reward, terminated, _, info = env.step("<answer></answer>")  # invalid: no attempt spent
    assert not info["action_is_valid"] and info["attempts"] == 1
    obs, reward, terminated, _, info = env.step("<answer>48</answer>")
    assert (reward, terminated, info["success"], info["attempts"]) == (1.0, True, True, 2)
    assert "correct" in obs["text"]

    env = _env_with("triangle_perimeter", {"a": 12, "b": 16, "c": 20}, TEXT)
    for k in range(3):
        obs, reward, terminated, truncated, info = env.step(f"<answer>{k}</answer>")
    assert terminated and not info["success"] and reward == 0.0 and info["gold_answer"] == "48"
    assert "try again" not in obs["text"] and "The answer was 48." in obs["text"]  # told once the answers are over
    assert env.unwrapped.render_text() == env.unwrapped.problem.statement


def test_max_turns_defaults_to_one_spare_reply_and_bad_settings_are_refused() -> None:
    env = envs.make(VISION, max_attempts=2)
    assert env.unwrapped.max_turns == 3
    env.reset(seed=0)
    for _ in range(2):
        *_, terminated, truncated, _ = env.step("no answer tag")
    *_, terminated, truncated, _ = env.step("still no answer tag")
    assert truncated and not terminated
    with pytest.raises(ValueError, match="unknown preset"):
        envs.make(VISION, preset="impossible")
    with pytest.raises(ValueError, match="max_attempts"):
        envs.make(VISION, max_attempts=0)
    with pytest.raises(ValueError):
        envs.make(VISION).reset(options={"problem": {"kind": "circle_chord", "params": {"r": 3, "d": 5}}})
    with pytest.raises(ValueError):
        envs.make(VISION).reset(options={"problem": {"kind": "hexagon", "params": {}}})


def test_random_replies_are_well_formed_and_never_the_answers_value_by_construction() -> None:
    env = envs.make(VISION, preset="mixed")
    rng = np.random.default_rng(0)
    hits = total = 0
    for seed in range(60):
        env.reset(seed=seed)
        gold = env.unwrapped.problem.answer.text()
        for _ in range(5):
            reply = env.unwrapped.sample_reply(rng)
            content, error = env.unwrapped.parse_action(reply)
            assert error is None
            hits += reply == f"<answer>{gold}</answer>"
            total += 1
    assert hits / total < 0.1


def test_human_play_in_the_terminal(tmp_path) -> None:
    import io

    out = io.StringIO()
    gif = tmp_path / "geometry.gif"
    seed = 5
    env = envs.make(TEXT)
    env.reset(seed=seed)
    gold = env.unwrapped.problem.answer.text()
    summary = play(VISION, seed=seed, stdin=io.StringIO(f"12345\n{gold}\n"), stdout=out, save_gif=str(gif))
    assert summary.success and summary.turns == 2 and gif.exists()
    text = out.getvalue()
    assert "the model sees a picture of:" in text  # the figure in words, for a terminal
    assert env.unwrapped.problem.statement in text


def test_outcome_text_is_the_figure_in_words_until_the_episode_ends() -> None:
    """Pretraining's observe and dynamics targets: the picture's values in words while attempts
    are left, ``correct`` / ``not correct`` at the end."""
    env = _env_with("rectangle", {"w": 4, "h": 9, "ask": "area"})
    task = env.unwrapped
    assert task.outcome_text(False, False) == "Rectangle ABCD has AB = 4 and BC = 9."
    assert task.outcome_text(True, True) == "correct" and task.outcome_text(True, False) == "not correct"
