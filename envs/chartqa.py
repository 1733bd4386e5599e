"""Questions about a chart: ``freshper/ChartQA-v0``.

Every ``reset`` draws a chart of generated data from the seeded RNG, a bar chart, a line chart
or a pie chart, with each value written on it, and a question whose answer is read or computed
from it. The chart is the only place the data is: the text names the categories a question is
about but holds no value (and no digit at all). Answers are exact: a whole number, a category
or month name, or ``rise``/``fall``; an average is asked to one decimal place (within 0.05).
:mod:`envs.figure_qa` reads and checks them, never running them.

Params: ``chart`` (bar|line|pie), ``labels`` (category names, months for a line chart),
``values`` (whole numbers; a pie's add up to 100, its percentages) and ``question``:

- ``max`` / ``min``: the label with the largest / smallest value (always unique);
- ``value`` (``a``): the value of label ``a``;
- ``diff`` (``a``, ``b``): value of ``a`` minus value of ``b`` (``a`` the larger);
- ``sum``: the total of all values; ``pair_sum`` (``a``, ``b``): value of ``a`` plus value of ``b``;
- ``average``: the mean value, to one decimal place;
- ``count_above`` (``a``): how many labels have a larger value than ``a``;
- ``trend`` (line): ``rise`` or ``fall`` from the first month to the last (never equal);
- ``increases`` (line): in how many months the value went up from the month before;
- ``change`` (line): value of the last month minus the first (negative when it fell).

Presets: ``grid`` (bar charts of 3-4 categories drawn on a grid of squares, one square per unit
of value, values 1-5; largest, smallest, a value), ``grid_value`` (the same charts, every question
the value of the k-th bar from the left), ``easy`` (bar charts of 3-4 categories;
largest, smallest, a value), ``medium`` (bar, line and pie charts of 4-6; also differences, a
trend, a share) and ``hard`` (5-7; sums, averages, counts, changes, increases).

The ``grid`` preset (``params["grid"]: true``) is the chart a small vision tower can read: each bar
is one square wide and as many squares high as its value, a square being one 28-pixel visual token
when the picture is a whole number of them (``image_size=[140, 140]``: five by five). A category's
name under its bar would be a few pixels of letters, so each category has its own colour on every
grid chart (``GRID_COLOURS``: its bar is found by what it looks like, wherever it stands) and the
text names the categories from left to right. Its answers are one digit each: a value, or for the
largest and the smallest the bar's place from the left (a name is several tokens the tiny model's
tokenizer splits, and copying one is a skill of its own). Its figure in words (the observe examples'
target and ``--reasoning state``'s think tag) is the values alone in the bars' order ("The bars from
left to right are 3 4 5 4 squares high."), one token per value as the picture has one square per bar
in a row: bar i's value is written as far after the bottom square of bar i as every other bar's
after its own (the figure tasks put the picture last in the text). The values are still only in the
picture.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
from PIL import Image, ImageDraw

from envs.base import ClientKwarg
from envs.figure_qa import SUPERSAMPLE, Answer, FigureQAEnv, Problem, choose, font, number_word

CATEGORIES = ("apple", "pear", "plum", "fig", "kiwi", "lime", "grape", "mango", "peach", "melon", "lemon", "cherry")
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
CHARTS = ("bar", "line", "pie")
#: Preset -> (charts, number of labels (low, high), largest value, questions per chart).
PRESETS: dict[str, dict[str, Any]] = {
    "grid": {"charts": ("bar",), "n": (3, 4), "top": 5, "questions": {"bar": ("max", "min", "value")}, "grid": True},
    "grid_value": {"charts": ("bar",), "n": (3, 4), "top": 5, "questions": {"bar": ("value",)}, "grid": True},
    "easy": {"charts": ("bar",), "n": (3, 4), "top": 20, "questions": {"bar": ("max", "min", "value")}},
    "medium": {"charts": CHARTS, "n": (4, 6), "top": 50,
               "questions": {"bar": ("max", "min", "value", "diff"), "line": ("value", "max", "trend", "diff"),
                             "pie": ("max", "min", "value", "diff")}},
    "hard": {"charts": CHARTS, "n": (5, 7), "top": 99,
             "questions": {"bar": ("sum", "average", "count_above", "diff"),
                           "line": ("change", "increases", "average", "diff"),
                           "pie": ("pair_sum", "count_above", "diff", "min")}},
}
QUESTIONS = ("max", "min", "value", "diff", "sum", "pair_sum", "average", "count_above", "trend", "increases",
             "change")
#: The largest value a grid chart draws (its bars are this many squares high at most).
GRID_TOP = 12
#: A grid chart's square: one visual token of a Qwen2-VL-style vision tower (14-pixel patches merged 2 x 2).
GRID_SQUARE = 28
#: Each category's colour on grid charts: twelve colours far apart.
GRID_COLOURS = {"apple": (230, 25, 75), "pear": (60, 180, 75), "plum": (145, 30, 180), "fig": (128, 64, 0),
                "kiwi": (0, 128, 128), "lime": (210, 245, 60), "grape": (0, 0, 128), "mango": (245, 130, 48),
                "peach": (240, 50, 230), "melon": (70, 240, 240), "lemon": (255, 225, 25), "cherry": (128, 0, 0)}
_PALETTE = ((66, 118, 196), (230, 126, 34), (46, 160, 90), (200, 60, 60), (142, 94, 180), (120, 90, 60),
            (220, 100, 170), (110, 110, 110))


def _unique_extremes(values: list[int]) -> bool:
    return values.count(max(values)) == 1 and values.count(min(values)) == 1


def _draw_values(rng: np.random.Generator, chart: str, n: int, top: int) -> list[int]:
    while True:
        if chart == "pie":  # percentages of at least 5 that add up to 100: n parts >= 1 of 100 - 4n, plus 4 each
            m = 100 - 4 * n
            cuts = np.sort(rng.choice(np.arange(1, m), n - 1, replace=False))
            values = [int(v) + 4 for v in np.diff(np.concatenate([[0], cuts, [m]]))]
        else:
            values = [int(v) for v in rng.integers(1, top + 1, n)]
        if _unique_extremes(values) and len(set(values)) > 1:
            return values


def draw_params(rng: np.random.Generator, preset: str) -> dict[str, Any]:
    """A chart and a question of ``preset`` drawn from ``rng``."""
    spec = PRESETS[preset]
    chart = choose(rng, spec["charts"])
    n = int(rng.integers(spec["n"][0], spec["n"][1] + 1))
    if chart == "line":
        start = int(rng.integers(len(MONTHS) - n + 1))
        labels = list(MONTHS[start:start + n])
    else:
        labels = [CATEGORIES[i] for i in rng.choice(len(CATEGORIES), n, replace=False)]
    values = _draw_values(rng, chart, n, spec["top"])
    kind = choose(rng, spec["questions"][chart])
    question: dict[str, Any] = {"type": kind}
    if kind in ("value", "count_above"):
        question["a"] = choose(rng, labels)
    elif kind in ("diff", "pair_sum"):
        i, j = (int(v) for v in rng.choice(n, 2, replace=False))
        while values[i] == values[j]:
            i, j = (int(v) for v in rng.choice(n, 2, replace=False))
        if values[i] < values[j]:
            i, j = j, i
        question["a"], question["b"] = labels[i], labels[j]
    elif kind == "trend" and values[0] == values[-1]:
        values[-1] = values[-1] + 1 if values[-1] < spec["top"] else values[-1] - 1
    params = {"chart": chart, "labels": labels, "values": values, "question": question}
    if spec.get("grid"):
        params["grid"] = True
    return params


def build_problem(kind: str, params: dict[str, Any]) -> Problem:
    """The chart question ``params`` (``kind`` is its chart): answer, words and question."""
    chart, labels, values, q = params.get("chart"), params.get("labels"), params.get("values"), params.get("question")
    if chart not in CHARTS or chart != kind:
        raise ValueError(f"chart must be one of {list(CHARTS)} and equal the kind, got {chart!r} / {kind!r}")
    if not (isinstance(labels, list) and isinstance(values, list) and 2 <= len(labels) == len(values) <= 12
            and len(set(labels)) == len(labels) and all(isinstance(v, str) and v for v in labels)
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 1000 for v in values)):
        raise ValueError("a chart needs 2-12 distinct labels and as many whole values in [0, 1000]")
    if chart == "pie" and sum(values) != 100:
        raise ValueError("a pie chart's values are percentages adding up to 100")
    grid = params.get("grid", False)
    if grid not in (True, False):
        raise ValueError(f"grid must be true or false, got {grid!r}")
    if grid and (chart != "bar" or not all(1 <= v <= GRID_TOP for v in values)):
        raise ValueError(f"a grid chart is a bar chart of values 1-{GRID_TOP}")
    if not isinstance(q, dict) or q.get("type") not in QUESTIONS:
        raise ValueError(f"question must be a dict whose type is one of {list(QUESTIONS)}")
    value_of = dict(zip(labels, values))
    for key in ("a", "b"):
        if key in q and q[key] not in value_of:
            raise ValueError(f"question label {q[key]!r} is not on the chart")
    t, a, b = q["type"], q.get("a"), q.get("b")
    unit = " percent" if chart == "pie" else ""
    what, whats = ("month", "months") if chart == "line" else ("category", "categories")
    thing = "share" if chart == "pie" else "value"
    labels_choice = tuple(labels)
    if t in ("max", "min"):
        best = max(values) if t == "max" else min(values)
        if values.count(best) != 1:
            raise ValueError(f"the {t} of this chart is not unique")
        extreme = 'largest' if t == 'max' else 'smallest'
        if grid:  # the bar's place from the left, a one-digit answer
            answer = Answer(Fraction(values.index(best) + 1))
            ask = f"Which bar has the {extreme} {thing}? Answer with its place from the left (one for the first bar)."
        else:
            answer = Answer(labels[values.index(best)], choices=labels_choice)
            ask = f"Which {what} has the {extreme} {thing}? Answer with its name."
    elif t == "value":
        _need(a)
        answer = Answer(Fraction(value_of[a]))
        if grid:
            ask = f"What is the {thing} of {a}, the {_ORDINALS[labels.index(a)]} bar from the left?"
        else:
            ask = f"What is the {thing} of {a}{' in percent' if chart == 'pie' else ''}?"
    elif t == "diff":
        _need(a, b)
        answer = Answer(Fraction(value_of[a] - value_of[b]))
        ask = f"How much larger is the {thing} of {a} than that of {b}{' in percentage points' if chart == 'pie' else ''}?"
    elif t == "sum":
        answer = Answer(Fraction(sum(values)))
        ask = "What is the total of all the values?"
    elif t == "pair_sum":
        _need(a, b)
        answer = Answer(Fraction(value_of[a] + value_of[b]))
        ask = f"What is the combined {thing} of {a} and {b}{' in percent' if chart == 'pie' else ''}?"
    elif t == "average":
        answer = Answer(sum(values) / len(values), 1)
        ask = f"What is the average {thing}, to one decimal place?"
    elif t == "count_above":
        _need(a)
        answer = Answer(Fraction(sum(v > value_of[a] for v in values)))
        ask = f"How many {whats} have a larger {thing} than {a}?"
    elif t in ("trend", "increases", "change"):
        if chart != "line":
            raise ValueError(f"a {t} question needs a line chart")
        if t == "trend":
            if values[0] == values[-1]:
                raise ValueError("a trend question needs different first and last values")
            answer = Answer("rise" if values[-1] > values[0] else "fall", choices=("rise", "fall"))
            ask = f"Overall, did the value rise or fall from {labels[0]} to {labels[-1]}? Answer rise or fall."
        elif t == "increases":
            answer = Answer(Fraction(sum(y > x for x, y in zip(values, values[1:]))))
            ask = "In how many months did the value go up from the month before?"
        else:
            answer = Answer(Fraction(values[-1] - values[0]))
            ask = (f"By how much did the value change from {labels[0]} to {labels[-1]}? "
                   "Write a fall as a negative number.")
    else:  # pragma: no cover (QUESTIONS is checked above)
        raise ValueError(t)
    title = {"bar": "a bar chart", "line": "a line chart", "pie": "a pie chart"}[chart]
    if grid:  # the values alone, in the bars' order: each at the same place in every transcription of n bars
        statement = f"The bars from left to right are {' '.join(str(v) for v in values)} squares high."
        figure = (f"The figure is {title} of {number_word(len(labels))} {whats}, from left to right "
                  f"{', '.join(labels)}; each bar is as many squares high as its {thing}.")
    else:
        data = ", ".join(f"{label} {value}{unit}" for label, value in zip(labels, values))
        statement = f"The figure is {title} of {number_word(len(labels))} {whats}: {data}."
        figure = f"The figure is {title} of {number_word(len(labels))} {whats}, each with its {thing} written on it."
    return Problem(chart, params, answer, statement, figure, ask, tuple(values))


_ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
             "eleventh", "twelfth")


def _need(*labels: Any) -> None:
    if any(label is None for label in labels):
        raise ValueError("this question names its label(s) in 'a' (and 'b')")


def draw_problem(rng: np.random.Generator, preset: str) -> Problem:
    params = draw_params(rng, preset)
    return build_problem(params["chart"], params)


# -- pictures ---------------------------------------------------------------------------------------
def draw_figure(problem: Problem, size: tuple[int, int]) -> np.ndarray:
    """The chart: values written on the bars, beside the points, or in the pie's legend."""
    p = problem.params
    if p.get("grid"):
        return _draw_grid(p["labels"], p["values"], size)
    s = SUPERSAMPLE
    w, h = size[0] * s, size[1] * s
    image = Image.new("RGB", (w, h), (255, 255, 255))
    d = ImageDraw.Draw(image)
    small = font(11 * s)
    labels, values = p["labels"], p["values"]
    n = len(values)

    def centred(x: float, y: float, text: str, fill=(20, 20, 20)) -> None:
        left, top, right, bottom = d.textbbox((0, 0), text, font=small)
        d.text((x - (right - left) / 2 - left, y - (bottom - top) / 2 - top), text, fill=fill, font=small)

    if p["chart"] in ("bar", "line"):
        x0, x1, y0, y1 = 14 * s, w - 10 * s, h - 24 * s, 14 * s  # plot area: left, right, bottom (axis), top
        top = max(values)
        scale = (y0 - y1 - 14 * s) / max(top, 1)
        d.line([(x0, y0), (x1, y0)], fill=(40, 40, 40), width=s)
        slot = (x1 - x0) / n
        points = []
        for i, (label, value) in enumerate(zip(labels, values)):
            cx = x0 + slot * (i + 0.5)
            y = y0 - value * scale
            centred(cx, y0 + 11 * s, label)
            if p["chart"] == "bar":
                half = min(slot * 0.32, 22 * s)
                d.rectangle([cx - half, y, cx + half, y0], fill=_PALETTE[i % len(_PALETTE)])
                centred(cx, y - 8 * s, str(value))
            points.append((cx, y))
        if p["chart"] == "line":
            colour = _PALETTE[0]
            d.line(points, fill=colour, width=2 * s)
            for i, (cx, y) in enumerate(points):
                r = 3 * s
                d.ellipse([cx - r, y - r, cx + r, y + r], fill=colour)
                # the value above the point, or below it where the line comes down to it from above on both sides
                before = points[i - 1][1] if i > 0 else y + 1
                after = points[i + 1][1] if i + 1 < n else y + 1
                below = before < y and after < y
                centred(cx, y + (11 if below else -11) * s, str(values[i]))
    else:  # pie: the pie on the left, a legend with each share on the right
        radius = min(h * 0.42, w * 0.26)
        cx, cy = w * 0.30, h / 2
        start = -90.0
        for i, value in enumerate(values):
            end = start + 360.0 * value / 100
            d.pieslice([cx - radius, cy - radius, cx + radius, cy + radius], start, end, fill=_PALETTE[i % len(_PALETTE)],
                       outline=(255, 255, 255), width=s)
            start = end
        row = min(22 * s, (h - 20 * s) / n)
        lx, ly = w * 0.60, h / 2 - row * (n - 1) / 2
        for i, (label, value) in enumerate(zip(labels, values)):
            y = ly + row * i
            d.rectangle([lx, y - 5 * s, lx + 10 * s, y + 5 * s], fill=_PALETTE[i % len(_PALETTE)])
            text = f"{label} {value}%"
            left, top, right, bottom = d.textbbox((0, 0), text, font=small)
            d.text((lx + 15 * s - left, y - (bottom - top) / 2 - top), text, fill=(20, 20, 20), font=small)
    return np.asarray(image.resize(size, Image.LANCZOS), dtype=np.uint8)


def _draw_grid(labels: list[str], values: list[int], size: tuple[int, int]) -> np.ndarray:
    """A grid chart: a column of squares per bar, as many as its value, in its category's colour
    (:data:`GRID_COLOURS`; another label gets one of the palette's by its place), over light grid lines,
    with the value of each row written in the first column (the axis) and the squares in the
    picture's bottom-left corner. Where the picture is a whole number of :data:`GRID_SQUARE`
    pixels each way, a square is the largest whole number of them that fits the axis, the bars
    and the rows (one at 140 x 140 and at 336 x 252), so squares sit on visual tokens; otherwise
    the largest size that fits."""
    w, h = size
    n, rows = len(values), max(max(values), PRESETS["grid"]["top"])
    cell = min(w // (n + 1), h // rows)
    if cell >= GRID_SQUARE and w % GRID_SQUARE == 0 and h % GRID_SQUARE == 0:
        cell = GRID_SQUARE * (cell // GRID_SQUARE)
    image = Image.new("RGB", (w, h), (255, 255, 255))
    d = ImageDraw.Draw(image)
    bottom = h
    small = font(max(8, cell * 11 // 28))
    for r in range(rows):
        y0 = bottom - (r + 1) * cell
        text = str(r + 1)
        left, top, right, low = d.textbbox((0, 0), text, font=small)
        d.text((cell / 2 - (right - left) / 2 - left, y0 + cell / 2 - (low - top) / 2 - top), text,
               fill=(90, 90, 90), font=small)
    for i, (label, value) in enumerate(zip(labels, values)):
        x0 = (i + 1) * cell
        colour = GRID_COLOURS.get(label, _PALETTE[i % len(_PALETTE)])
        d.rectangle([x0, bottom - value * cell, x0 + cell - 1, bottom - 1], fill=colour)
    for k in range(rows + 1):  # grid lines over the plot: every square's edge, the bars' too
        d.line([(cell, bottom - k * cell), ((n + 1) * cell - 1, bottom - k * cell)], fill=(210, 210, 210))
    for k in range(1, n + 2):
        d.line([(k * cell, bottom - rows * cell), (k * cell, bottom - 1)], fill=(210, 210, 210))
    return np.asarray(image, dtype=np.uint8)


class ChartQAEnv(FigureQAEnv):
    """A question about a chart of generated data; the chart is the only place the data is.

    Args:
        preset: ``easy`` (the default), ``medium``, ``hard`` or ``grid`` (draw it at
            ``image_size=[140, 140]``: one 28-pixel square per unit).
        max_attempts: answers per episode (2); a wrong one with an attempt left is told so.
        image_size: the chart's ``(width, height)`` (336 x 252: 12 x 9 tiles of 28 pixels).
    """

    modality = "vision"
    PRESETS: ClassVar = PRESETS
    DEFAULT_PRESET: ClassVar[str] = "easy"
    DEFAULT_ATTEMPTS: ClassVar[int] = 2
    DEFAULT_IMAGE_SIZE: ClassVar[tuple[int, int]] = (336, 252)
    topic: ClassVar[str] = "Answer the question about the chart"
    client_kwargs: ClassVar = {**FigureQAEnv.client_kwargs, "preset": ClientKwarg(str, choices=tuple(PRESETS))}

    draw_problem = staticmethod(draw_problem)
    build_problem = staticmethod(build_problem)
    draw_figure = staticmethod(draw_figure)
