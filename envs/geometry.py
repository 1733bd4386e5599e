"""Plane-geometry problems with a drawn diagram: ``freshper/GeometryVision-v0`` and its text twin
``freshper/Geometry-v0``.

Every ``reset`` draws a problem from the seeded RNG: a kind of the preset and its values. The
vision task shows the diagram, with labelled points and the given values written on it, and asks
a question that holds none of them (its text has no digit at all: the values are only in the
picture); the text twin states the same figure in words, values included. The answer is a
number: exact (``17.5``, ``35/2``), or, where the question says so, to one decimal place
(within 0.05); :mod:`envs.figure_qa` reads and checks it, never running it.

Kinds (``params`` in brackets; sides and angles are whole numbers, angles in degrees):

- ``triangle_angle`` (``A``, ``B``): two angles of triangle ABC -> angle C = 180 - A - B.
- ``triangle_perimeter`` (``a``, ``b``, ``c``: BC, CA, AB) -> a + b + c.
- ``rectangle`` (``w``, ``h``, ``ask`` area|perimeter) -> w h or 2 (w + h).
- ``parallel_lines`` (``theta``, ``given``, ``asked``): lines l (top) and m (bottom) parallel,
  cut by a transversal at P (on l) and Q (on m); ``theta`` is the angle above the line and right
  of the transversal; ``given`` and ``asked`` are ``[point, quadrant]``, quadrant one of ``UR UL
  LL LR`` (above/below the line, right/left of the transversal); a quadrant's angle is ``theta``
  for UR and LL, ``180 - theta`` for UL and LR -> the asked angle.
- ``right_triangle`` (``ask`` c|b, and the two given of ``a``, ``b``, ``c``): right angle at C,
  legs BC = a and CA = b, hypotenuse AB = c -> the missing side (Pythagoras).
- ``triangle_area`` (``base``, ``height``, ``foot``): base AB, apex C at ``height`` above it,
  the altitude's foot D at fraction ``foot`` of AB -> base * height / 2.
- ``inscribed_angle`` (``central``, ``ask`` inscribed|central): A, B, C on a circle with centre
  O, C on the major arc; angle AOB = ``central``, angle ACB = central / 2 -> the one not given.
- ``circle_chord`` (``r``, ``d``): chord AB at distance OM = d from the centre, radius OA = r ->
  AB = 2 sqrt(r^2 - d^2).
- ``circle_tangent`` (``r``, ``d``): tangent from P touching at T, OT = r, OP = d -> PT =
  sqrt(d^2 - r^2).
- ``law_of_cosines`` (``a``, ``b``, ``C``): sides BC = a, CA = b and the angle C between them ->
  AB = sqrt(a^2 + b^2 - 2ab cos C).
- ``circle_measure`` (``r``, ``ask`` area|circumference) -> pi r^2 or 2 pi r.

Presets: ``easy`` (the first four, whole-number answers), ``medium`` (right triangles and chords
and tangents from Pythagorean triples, areas, inscribed angles: exact answers), ``hard`` (law of
cosines, any right triangle, chord, tangent, circle measures: answers to one decimal place), and
``mixed`` (every kind at every level).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np

from envs.base import ClientKwarg
from envs.figure_qa import ASK_INK, GIVEN_INK, Answer, Canvas, FigureQAEnv, Problem, choose, fmt

#: Preset -> the (kind, level) pairs it draws from, uniformly.
PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
    "easy": (("triangle_angle", "easy"), ("triangle_perimeter", "easy"), ("rectangle", "easy"),
             ("parallel_lines", "easy")),
    "medium": (("right_triangle", "medium"), ("triangle_area", "medium"), ("inscribed_angle", "medium"),
               ("circle_chord", "medium"), ("circle_tangent", "medium")),
    "hard": (("right_triangle", "hard"), ("law_of_cosines", "hard"), ("circle_chord", "hard"),
             ("circle_tangent", "hard"), ("circle_measure", "hard")),
}
PRESETS["mixed"] = PRESETS["easy"] + PRESETS["medium"] + PRESETS["hard"]
KINDS = ("triangle_angle", "triangle_perimeter", "rectangle", "parallel_lines", "right_triangle", "triangle_area",
         "inscribed_angle", "circle_chord", "circle_tangent", "law_of_cosines", "circle_measure")
QUADRANTS = ("UR", "UL", "LL", "LR")
_QUADRANT_WORDS = {"UR": "above {line} and right of the transversal", "UL": "above {line} and left of the transversal",
                   "LL": "below {line} and left of the transversal", "LR": "below {line} and right of the transversal"}
#: Primitive Pythagorean triples (leg, leg, hypotenuse) the exact presets scale.
TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29))
DEG = "°"


# -- drawing the values of each kind ------------------------------------------------------------------
def _draw_params(rng: np.random.Generator, kind: str, level: str) -> dict[str, Any]:
    r = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731  (inclusive bounds)
    if kind == "triangle_angle":
        a = r(25, 110)
        return {"A": a, "B": r(25, 150 - a)}
    if kind == "triangle_perimeter":
        while True:
            a, b, c = r(3, 20), r(3, 20), r(3, 20)
            if a + b > c + 1 and b + c > a + 1 and a + c > b + 1:  # not too flat to draw
                return {"a": a, "b": b, "c": c}
    if kind == "rectangle":
        return {"w": r(2, 15), "h": r(2, 15), "ask": choose(rng, ("area", "perimeter"))}
    if kind == "parallel_lines":
        theta = r(35, 80) if rng.random() < 0.5 else r(100, 145)
        given = [choose(rng, ("P", "Q")), choose(rng, QUADRANTS)]
        while True:
            asked = [choose(rng, ("P", "Q")), choose(rng, QUADRANTS)]
            if asked != given:
                return {"theta": theta, "given": given, "asked": asked}
    if kind == "right_triangle":
        if level == "medium":
            leg1, leg2, hyp = choose(rng, TRIPLES)
            k = r(1, max(1, 30 // hyp))
            a, b, c = (leg1 * k, leg2 * k, hyp * k) if rng.random() < 0.5 else (leg2 * k, leg1 * k, hyp * k)
        else:
            a, b = r(2, 15), r(2, 15)
            if rng.random() < 0.5:
                return {"ask": "c", "a": a, "b": b}
            c = r(max(a, 3) + 1, 20)
            return {"ask": "b", "a": a, "c": c}
        return {"ask": "c", "a": a, "b": b} if rng.random() < 0.5 else {"ask": "b", "a": a, "c": c}
    if kind == "triangle_area":
        return {"base": r(3, 20), "height": r(2, 15), "foot": round(float(rng.uniform(0.2, 0.8)), 2)}
    if kind == "inscribed_angle":
        return {"central": 2 * r(20, 80), "ask": choose(rng, ("inscribed", "central"))}
    if kind == "circle_chord":
        if level == "medium":
            leg1, leg2, hyp = choose(rng, TRIPLES)
            k = r(1, max(1, 25 // hyp))
            d = (leg1 if rng.random() < 0.5 else leg2) * k
            return {"r": hyp * k, "d": d}
        rad = r(4, 15)
        return {"r": rad, "d": r(1, rad - 1)}
    if kind == "circle_tangent":
        if level == "medium":
            leg1, leg2, hyp = choose(rng, TRIPLES)
            k = r(1, max(1, 25 // hyp))
            rad = (leg1 if rng.random() < 0.5 else leg2) * k
            return {"r": rad, "d": hyp * k}
        rad = r(2, 12)
        return {"r": rad, "d": r(rad + 1, rad + 12)}
    if kind == "law_of_cosines":
        return {"a": r(3, 15), "b": r(3, 15), "C": r(20, 150)}
    if kind == "circle_measure":
        return {"r": r(1, 15), "ask": choose(rng, ("area", "circumference"))}
    raise ValueError(f"unknown geometry kind {kind!r}; kinds are {list(KINDS)}")


def quadrant_angle(theta: float, quadrant: str) -> float:
    """The angle in ``quadrant`` at a crossing whose angle above the line and right of the
    transversal is ``theta``: vertical angles are equal, neighbours add up to 180."""
    return theta if quadrant in ("UR", "LL") else 180 - theta


def _check(condition: bool, kind: str, params: dict[str, Any]) -> None:
    if not condition:
        raise ValueError(f"invalid {kind} problem {params}")


def _num(params: dict[str, Any], key: str, lo: float, hi: float) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"problem parameter {key!r} must be a whole number in [{lo:g}, {hi:g}], got {value!r}")
    return value


def build_problem(kind: str, params: dict[str, Any]) -> Problem:
    """The problem of ``kind`` with ``params``: its answer, its words and its question (the
    task's own solver; tests recompute the answers independently)."""
    p = params
    if kind == "triangle_angle":
        a, b = _num(p, "A", 1, 178), _num(p, "B", 1, 178)
        _check(a + b < 180, kind, p)
        return Problem(kind, p, Answer(Fraction(180 - a - b)),
                       f"In triangle ABC, angle A = {a}{DEG} and angle B = {b}{DEG}.",
                       "The figure shows triangle ABC with two of its angles marked and angle C marked ?.",
                       "What is angle C, in degrees?", (a, b))
    if kind == "triangle_perimeter":
        a, b, c = (_num(p, k, 1, 1000) for k in "abc")
        _check(a + b > c and b + c > a and a + c > b, kind, p)
        return Problem(kind, p, Answer(Fraction(a + b + c)),
                       f"Triangle ABC has sides AB = {c}, BC = {a} and CA = {b}.",
                       "The figure shows triangle ABC with the length of each side marked.",
                       "What is the perimeter of triangle ABC?", (a, b, c))
    if kind == "rectangle":
        w, h = _num(p, "w", 1, 1000), _num(p, "h", 1, 1000)
        ask = p.get("ask")
        _check(ask in ("area", "perimeter"), kind, p)
        value = w * h if ask == "area" else 2 * (w + h)
        return Problem(kind, p, Answer(Fraction(value)),
                       f"Rectangle ABCD has AB = {w} and BC = {h}.",
                       "The figure shows rectangle ABCD with its side lengths marked.",
                       f"What is the {ask} of rectangle ABCD?", (w, h))
    if kind == "parallel_lines":
        theta = _num(p, "theta", 1, 179)
        given, asked = p.get("given"), p.get("asked")
        for where in (given, asked):
            _check(isinstance(where, list) and len(where) == 2 and where[0] in ("P", "Q") and where[1] in QUADRANTS,
                   kind, p)
        _check(given != asked, kind, p)
        value = quadrant_angle(theta, asked[1])
        shown = quadrant_angle(theta, given[1])
        line = {"P": "line l", "Q": "line m"}
        return Problem(kind, p, Answer(Fraction(value)),
                       f"Parallel lines l (top) and m (bottom) are cut by a transversal at P on l and Q on m. At "
                       f"{given[0]}, the angle {_QUADRANT_WORDS[given[1]].format(line=line[given[0]])} is "
                       f"{shown}{DEG}. Angle x is the angle at {asked[0]} "
                       f"{_QUADRANT_WORDS[asked[1]].format(line=line[asked[0]])}.",
                       "In the figure, parallel lines l and m are cut by a transversal at P and Q; one angle is "
                       "marked and another is marked x.", "What is angle x, in degrees?", (shown,))
    if kind == "right_triangle":
        ask = p.get("ask")
        _check(ask in ("b", "c"), kind, p)
        a = _num(p, "a", 1, 1000)
        if ask == "c":
            b = _num(p, "b", 1, 1000)
            exact = math.isqrt(a * a + b * b) ** 2 == a * a + b * b
            value: Any = Fraction(math.isqrt(a * a + b * b)) if exact else math.hypot(a, b)
            statement = f"Triangle ABC has a right angle at C, BC = {a} and CA = {b}."
            question, given = "What is the length of the hypotenuse AB", (a, b)
        else:
            c = _num(p, "c", 2, 1000)
            _check(c > a, kind, p)
            exact = math.isqrt(c * c - a * a) ** 2 == c * c - a * a
            value = Fraction(math.isqrt(c * c - a * a)) if exact else math.sqrt(c * c - a * a)
            statement = f"Triangle ABC has a right angle at C, hypotenuse AB = {c} and BC = {a}."
            question, given = "What is the length of side CA", (a, c)
        return Problem(kind, p, Answer(value, None if exact else 1), statement,
                       "The figure shows right triangle ABC with two side lengths marked and the third marked ?.",
                       f"{question}{'' if exact else ', to one decimal place'}?", given)
    if kind == "triangle_area":
        base, height = _num(p, "base", 1, 1000), _num(p, "height", 1, 1000)
        foot = p.get("foot")
        _check(isinstance(foot, (int, float)) and 0 <= foot <= 1, kind, p)
        return Problem(kind, p, Answer(Fraction(base * height, 2)),
                       f"Triangle ABC has base AB = {base}; the altitude CD from C to AB has length {height}.",
                       "The figure shows triangle ABC with the lengths of its base AB and altitude CD marked.",
                       "What is the area of triangle ABC?", (base, height))
    if kind == "inscribed_angle":
        central = _num(p, "central", 2, 178)
        ask = p.get("ask")
        _check(central % 2 == 0 and ask in ("inscribed", "central"), kind, p)
        if ask == "inscribed":
            value, shown = central // 2, central
            statement = (f"Points A, B and C lie on a circle with centre O, C on the major arc AB. Angle AOB = "
                         f"{central}{DEG}.")
            question = "What is angle ACB, in degrees?"
        else:
            value, shown = central, central // 2
            statement = (f"Points A, B and C lie on a circle with centre O, C on the major arc AB. Angle ACB = "
                         f"{central // 2}{DEG}.")
            question = "What is angle AOB, in degrees?"
        return Problem(kind, p, Answer(Fraction(value)), statement,
                       "In the figure, A, B and C lie on the circle with centre O; one angle is marked and another "
                       "is marked x.", question, (shown,))
    if kind == "circle_chord":
        r, d = _num(p, "r", 2, 1000), _num(p, "d", 1, 999)
        _check(d < r, kind, p)
        half_sq = r * r - d * d
        exact = math.isqrt(half_sq) ** 2 == half_sq
        value = Fraction(2 * math.isqrt(half_sq)) if exact else 2 * math.sqrt(half_sq)
        return Problem(kind, p, Answer(value, None if exact else 1),
                       f"A circle has centre O and radius OA = {r}. Chord AB is at distance OM = {d} from O, M its "
                       "midpoint.",
                       "The figure shows a circle with centre O, the length of radius OA and the distance OM from O "
                       "to chord AB, M its midpoint.",
                       f"What is the length of chord AB{'' if exact else ', to one decimal place'}?", (r, d))
    if kind == "circle_tangent":
        r, d = _num(p, "r", 1, 1000), _num(p, "d", 2, 1000)
        _check(d > r, kind, p)
        sq = d * d - r * r
        exact = math.isqrt(sq) ** 2 == sq
        value = Fraction(math.isqrt(sq)) if exact else math.sqrt(sq)
        return Problem(kind, p, Answer(value, None if exact else 1),
                       f"A circle has centre O and radius OT = {r}. Line PT touches the circle at T, and OP = {d}.",
                       "The figure shows a circle with centre O, a line from P touching it at T, and the lengths "
                       "OT and OP.", f"What is the length PT{'' if exact else ', to one decimal place'}?", (r, d))
    if kind == "law_of_cosines":
        a, b, c_angle = _num(p, "a", 1, 1000), _num(p, "b", 1, 1000), _num(p, "C", 1, 179)
        value = math.sqrt(a * a + b * b - 2 * a * b * math.cos(math.radians(c_angle)))
        return Problem(kind, p, Answer(value, 1),
                       f"Triangle ABC has BC = {a}, CA = {b} and angle C = {c_angle}{DEG}.",
                       "The figure shows triangle ABC with sides BC and CA and the angle C between them marked.",
                       "What is the length of AB, to one decimal place?", (a, b, c_angle))
    if kind == "circle_measure":
        r = _num(p, "r", 1, 1000)
        ask = p.get("ask")
        _check(ask in ("area", "circumference"), kind, p)
        value = math.pi * r * r if ask == "area" else 2 * math.pi * r
        return Problem(kind, p, Answer(value, 1), f"A circle has centre O and radius {r}.",
                       "The figure shows a circle with centre O and its radius marked.",
                       f"What is the {ask} of the circle, to one decimal place (with the exact value of pi)?", (r,))
    raise ValueError(f"unknown geometry kind {kind!r}; kinds are {list(KINDS)}")


def draw_problem(rng: np.random.Generator, preset: str) -> Problem:
    """A problem of ``preset`` drawn from ``rng``: a (kind, level) of the preset, then its values."""
    kind, level = choose(rng, PRESETS[preset])
    return build_problem(kind, _draw_params(rng, kind, level))


# -- pictures ---------------------------------------------------------------------------------------
def _triangle(a: float, b: float, c: float) -> tuple[tuple[float, float], ...]:
    """Vertices A, B, C of the triangle with BC = a, CA = b, AB = c: A at the origin, B on the x axis."""
    x = (b * b + c * c - a * a) / (2 * c)
    y = math.sqrt(max(b * b - x * x, 1e-9))
    return (0.0, 0.0), (float(c), 0.0), (x, y)


def _shape(a: float, b: float, c: float) -> tuple[tuple[float, float], ...]:
    """A drawable triangle near these side lengths: diagrams are not to scale, and a very flat or
    thin triangle would leave no room for its labels."""
    s = sorted((a, b, c))
    if s[0] + s[1] < 1.25 * s[2]:
        scale = 1.25 * s[2] / (s[0] + s[1])
        a, b, c = (v * scale if v != s[2] else v for v in (a, b, c))
    return _triangle(a, b, c)


def _centroid(*points):
    return (sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points))


def draw_figure(problem: Problem, size: tuple[int, int]) -> np.ndarray:
    """The diagram of ``problem``: points labelled with letters, given values in blue, the unknown
    marked ``?`` or ``x`` in red."""
    kind, p = problem.kind, problem.params
    if kind in ("triangle_angle", "law_of_cosines"):
        if kind == "triangle_angle":
            ra, rb = math.radians(p["A"]), math.radians(p["B"])
            rc = math.pi - ra - rb
            A, B, C = _triangle(math.sin(ra), math.sin(rb), math.sin(rc))
        else:
            gc = math.radians(p["C"])
            # C at the origin, B along the x axis, A at angle C: to scale, but never too thin to read
            ratio = min(max(p["b"] / p["a"], 0.5), 2.0)
            C, B = (0.0, 0.0), (1.0, 0.0)
            A = (ratio * math.cos(gc), ratio * math.sin(gc))
        canvas = Canvas(size, [A, B, C])
        g = _centroid(A, B, C)
        canvas.polygon([A, B, C])
        for point, name in ((A, "A"), (B, "B"), (C, "C")):
            canvas.label_away(point, g, name, 12)
        if kind == "triangle_angle":
            canvas.angle_mark(A, B, C, f"{p['A']}{DEG}")
            canvas.angle_mark(B, A, C, f"{p['B']}{DEG}")
            canvas.angle_mark(C, A, B, "?", fill=ASK_INK)
        else:
            canvas.angle_mark(C, A, B, f"{p['C']}{DEG}")
            canvas.side_label(B, C, A, fmt(p["a"]))
            canvas.side_label(C, A, B, fmt(p["b"]))
            canvas.side_label(A, B, C, "?", fill=ASK_INK)
        return canvas.finish()
    if kind == "triangle_perimeter":
        A, B, C = _shape(p["a"], p["b"], p["c"])
        canvas = Canvas(size, [A, B, C])
        g = _centroid(A, B, C)
        canvas.polygon([A, B, C])
        for point, name in ((A, "A"), (B, "B"), (C, "C")):
            canvas.label_away(point, g, name, 12)
        canvas.side_label(B, C, A, fmt(p["a"]))
        canvas.side_label(C, A, B, fmt(p["b"]))
        canvas.side_label(A, B, C, fmt(p["c"]))
        return canvas.finish()
    if kind == "rectangle":
        w, h = float(p["w"]), float(p["h"])
        h = min(max(h, w / 2.5), w * 2.5)  # not to scale beyond 2.5:1
        A, B, C, D = (0.0, 0.0), (w, 0.0), (w, h), (0.0, h)
        canvas = Canvas(size, [A, B, C, D])
        g = _centroid(A, B, C, D)
        canvas.polygon([A, B, C, D])
        for point, name in ((A, "A"), (B, "B"), (C, "C"), (D, "D")):
            canvas.label_away(point, g, name, 12)
            canvas.right_angle(point, *[q for q in (A, B, C, D) if q != point and (q[0] == point[0] or q[1] == point[1])])
        canvas.side_label(A, B, g, fmt(p["w"]))
        canvas.side_label(B, C, g, fmt(p["h"]))
        return canvas.finish()
    if kind == "parallel_lines":
        t = math.radians(p["theta"])
        P, Q = (0.0, 1.0), (-math.cos(t) / math.sin(t), 0.0)  # Q below P along the transversal
        left, right = min(P[0], Q[0]) - 1.0, max(P[0], Q[0]) + 1.0
        direction = (math.cos(t), math.sin(t))
        top, bottom = (P[0] + 0.55 * direction[0] / direction[1], 1.55), (Q[0] - 0.55 * direction[0] / direction[1], -0.55)
        canvas = Canvas(size, [(left, -0.55), (right, 1.55)], margin=22)
        for y, name in ((1.0, "l"), (0.0, "m")):
            canvas.line((left, y), (right, y))
            canvas.text((right, y), name, offset=(-6, 10), box=False)
            mid = left + 0.35  # arrowheads: the lines are parallel
            canvas.line((mid - 0.12, y + 0.07), (mid, y), 2)
            canvas.line((mid - 0.12, y - 0.07), (mid, y), 2)
        canvas.line(bottom, top)
        rays = {"R": (1.0, 0.0), "L": (-1.0, 0.0), "U": direction, "D": (-direction[0], -direction[1])}
        for point, name in ((P, "P"), (Q, "Q")):
            canvas.dot(point)
            # the point's letter in a quadrant where no angle is marked, on its bisector
            used = {q for where, q in (p["given"], p["asked"]) if where == name}
            free = next(q for q in ("UL", "UR", "LR", "LL") if q not in used)
            u, v = rays["U" if free[0] == "U" else "D"], rays[free[1]]
            bx, by = u[0] + v[0], u[1] + v[1]
            n = math.hypot(bx, by) or 1.0
            canvas.text(point, name, offset=(bx / n * 14, by / n * 14), box=False)
        for (where, quadrant), label, ink in ((p["given"], f"{fmt(quadrant_angle(p['theta'], p['given'][1]))}{DEG}", GIVEN_INK),
                                              (p["asked"], "x", ASK_INK)):
            vertex = P if where == "P" else Q
            # the quadrant's rays: along the transversal up (U) or down (L: lower), along the line right or left
            ends = [(vertex[0] + rays[k][0], vertex[1] + rays[k][1]) for k in ("U" if quadrant[0] == "U" else "D",
                                                                               quadrant[1])]
            canvas.angle_mark(vertex, *ends, label, radius=13, fill=ink, text_distance=27)
        return canvas.finish()
    if kind == "right_triangle":
        a = p["a"]
        b = p["b"] if p["ask"] == "c" else math.sqrt(p["c"] ** 2 - a * a)
        ratio = min(max(b / a, 0.4), 2.5)
        C, B, A = (0.0, 0.0), (1.0, 0.0), (0.0, ratio)
        canvas = Canvas(size, [A, B, C])
        g = _centroid(A, B, C)
        canvas.polygon([A, B, C])
        for point, name in ((A, "A"), (B, "B"), (C, "C")):
            canvas.label_away(point, g, name, 12)
        canvas.right_angle(C, A, B, 10)
        canvas.side_label(B, C, A, fmt(a))
        if p["ask"] == "c":
            canvas.side_label(C, A, B, fmt(p["b"]))
            canvas.side_label(A, B, C, "?", fill=ASK_INK)
        else:
            canvas.side_label(C, A, B, "?", fill=ASK_INK)
            canvas.side_label(A, B, C, fmt(p["c"]))
        return canvas.finish()
    if kind == "triangle_area":
        base, height = float(p["base"]), float(p["height"])
        height = min(max(height, base / 3), base * 2)
        A, B = (0.0, 0.0), (base, 0.0)
        D = (p["foot"] * base, 0.0)
        C = (D[0], height)
        canvas = Canvas(size, [A, B, C])
        g = _centroid(A, B, C)
        canvas.polygon([A, B, C])
        canvas.line(C, D, 1, dash=5)
        canvas.right_angle(D, B, C, 8)
        for point, name in ((A, "A"), (B, "B"), (C, "C")):
            canvas.label_away(point, g, name, 12)
        canvas.text(D, "D", offset=(0, -11), box=False)
        canvas.side_label(A, B, C, fmt(p["base"]), distance=24)
        canvas.text(((C[0] + D[0]) / 2, (C[1] + D[1]) / 2), fmt(p["height"]), GIVEN_INK,
                    offset=(12 if p["foot"] < 0.5 else -12, 0))
        return canvas.finish()
    if kind == "inscribed_angle":
        half = math.radians(p["central"] / 2)
        O = (0.0, 0.0)
        A, B = (math.sin(-half), -math.cos(half)), (math.sin(half), -math.cos(half))  # symmetric about the y axis
        C = (-0.35, math.sqrt(1 - 0.35 ** 2))
        canvas = Canvas(size, [(-1.0, -1.0), (1.0, 1.0)], margin=26)
        canvas.circle(O, 1.0)
        canvas.line(O, A)
        canvas.line(O, B)
        canvas.line(C, A)
        canvas.line(C, B)
        for point in (O, A, B, C):
            canvas.dot(point)
        canvas.label_away(A, O, "A", 11)
        canvas.label_away(B, O, "B", 11)
        canvas.label_away(C, O, "C", 11)
        canvas.text(O, "O", offset=(0, 11), box=False)
        given_central = p["ask"] == "inscribed"
        canvas.angle_mark(O, A, B, f"{p['central']}{DEG}" if given_central else "x",
                          fill=GIVEN_INK if given_central else ASK_INK, radius=12, text_distance=24)
        canvas.angle_mark(C, A, B, "x" if given_central else f"{p['central'] // 2}{DEG}",
                          fill=ASK_INK if given_central else GIVEN_INK, radius=14, text_distance=30)
        return canvas.finish()
    if kind == "circle_chord":
        r, d = float(p["r"]), float(p["d"])
        depth = -min(d / r, 0.8)  # the chord below the centre (not to scale when it would be tiny)
        half = math.sqrt(1 - depth * depth)
        O, M, A, B = (0.0, 0.0), (0.0, depth), (-half, depth), (half, depth)
        canvas = Canvas(size, [(-1.0, -1.0), (1.0, 1.0)], margin=26)
        canvas.circle(O, 1.0)
        canvas.line(A, B)
        canvas.line(O, A, 2, GIVEN_INK)
        canvas.line(O, M, 1, dash=4)
        canvas.right_angle(M, O, B, 7)
        for point in (O, A, B, M):
            canvas.dot(point)
        canvas.text(O, "O", offset=(0, 11), box=False)
        canvas.label_away(A, O, "A", 11)
        canvas.label_away(B, O, "B", 11)
        canvas.text(M, "M", offset=(8, -11), box=False)
        canvas.side_label(O, A, B, fmt(p["r"]), distance=11)
        canvas.text((0.0, depth / 2), fmt(p["d"]), GIVEN_INK, offset=(13, 0))
        canvas.text((half / 2, depth), "?", ASK_INK, offset=(0, -11))
        return canvas.finish()
    if kind == "circle_tangent":
        r, d = float(p["r"]), float(p["d"])
        ratio = min(max(d / r, 1.6), 3.2)  # not to scale where PT would be tiny or the picture too wide
        O, P = (0.0, 0.0), (ratio, 0.0)
        angle = math.acos(1 / ratio)  # angle TOP
        T = (math.cos(angle), math.sin(angle))
        canvas = Canvas(size, [(-1.0, -1.0), (ratio, 1.0)], margin=26)
        canvas.circle(O, 1.0)
        canvas.line(O, T, 2, GIVEN_INK)
        canvas.line(O, P, 2, GIVEN_INK)
        canvas.line(P, T)
        canvas.right_angle(T, O, P, 7)
        for point in (O, P, T):
            canvas.dot(point)
        canvas.text(O, "O", offset=(-10, -8), box=False)
        canvas.text(P, "P", offset=(10, 0), box=False)
        canvas.label_away(T, O, "T", 11)
        canvas.side_label(O, T, P, fmt(p["r"]), distance=11)
        canvas.side_label(O, P, T, fmt(p["d"]), distance=11)
        canvas.side_label(P, T, O, "?", distance=11, fill=ASK_INK)
        return canvas.finish()
    if kind == "circle_measure":
        O, R = (0.0, 0.0), (math.cos(0.5), math.sin(0.5))
        canvas = Canvas(size, [(-1.0, -1.0), (1.0, 1.0)], margin=22)
        canvas.circle(O, 1.0)
        canvas.line(O, R, 2, GIVEN_INK)
        canvas.dot(O)
        canvas.text(O, "O", offset=(0, -11), box=False)
        canvas.side_label(O, R, (0.0, -1.0), fmt(p["r"]), distance=10)
        return canvas.finish()
    raise ValueError(f"unknown geometry kind {kind!r}")


class GeometryEnv(FigureQAEnv):
    """A plane-geometry problem stated in words; the answer is a number (see the module docstring).

    Args:
        preset: ``easy`` (the default), ``medium``, ``hard`` or ``mixed``.
        max_attempts: answers per episode (3); wrong ones with attempts left are told so.
        image_size: the diagram's ``(width, height)`` (252 x 252: 9 x 9 tiles of 28 pixels).
    """

    PRESETS: ClassVar = PRESETS
    DEFAULT_PRESET: ClassVar[str] = "easy"
    DEFAULT_ATTEMPTS: ClassVar[int] = 3
    topic: ClassVar[str] = "Solve the geometry problem"
    client_kwargs: ClassVar = {**FigureQAEnv.client_kwargs, "preset": ClientKwarg(str, choices=tuple(PRESETS))}

    draw_problem = staticmethod(draw_problem)
    build_problem = staticmethod(build_problem)
    draw_figure = staticmethod(draw_figure)


class GeometryVisionEnv(GeometryEnv):
    """The geometry problem with its diagram: the given values are on the picture alone."""

    modality = "vision"
