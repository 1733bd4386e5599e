"""What the figure tasks share (``envs/geometry.py``, ``envs/chartqa.py``): a problem drawn from the
seeded RNG, a question about it, an answer checked by the task, attempts with feedback, and the
drawing helpers their pictures are made with (Pillow, no other dependency).

A problem is its ``kind`` and its ``params`` (plain JSON values): everything else, the answer,
the words of the text twin, the question of the vision variant and the picture, is computed from
those, so ``reset(options={"problem": {"kind": ..., "params": ...}})`` plays any problem and a
record's ``info["problem"]`` rebuilds the episode.

Answers are data, never code: a reply's answer is read by the regular expressions below (an
integer, a decimal, a fraction ``a/b``, optionally followed by a unit word or sign such as
``°`` or ``%``; or a word for label answers) and compared with the stored answer: exactly
(``decimals=None``: ``17.5``, ``35/2`` and ``17.50`` are the same answer), or, where the task
says "to one decimal place", within half a unit of that place (``|x - answer| <= 0.05``). The
comparison runs inside :func:`envs.answer_guard.guarded`, like every scorer's.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from typing import Any, ClassVar, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from envs.answer_guard import guarded
from envs.base import COMMON_CLIENT_KWARGS, IMAGE_PLACEHOLDER, ClientKwarg, MultiTurnEnv, free_answer

#: A number as a reply may write it: an integer, a decimal or a fraction, with an optional sign.
_NUMBER = re.compile(r"^([+-]?)\s*(\d{1,12}(?:\.\d{1,12})?|\.\d{1,12}|\d{1,12}\s*/\s*\d{1,12})$")
#: Units a numeric answer may end with (ignored: the question names the unit).
_UNITS = ("square units", "sq units", "units", "unit", "degrees", "degree", "deg", "percent", "cm", "°", "%")
_NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                 "eleven", "twelve")
#: The longest answer read (a longer one is an invalid reply).
MAX_ANSWER_CHARS = 64
#: What a vision figure task's picture shows: the episode's own problem, or another problem's.
PICTURES = ("own", "another")


def number_word(n: int) -> str:
    """``3`` -> ``"three"`` (0-12; larger numbers as digits): counts in the vision variant's text,
    which holds no digits at all."""
    return _NUMBER_WORDS[n] if 0 <= n < len(_NUMBER_WORDS) else str(n)


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number written as an integer, a decimal or a fraction (``-3``,
    ``17.5``, ``35/2``), optionally with a unit after it (``12 cm``, ``40°``, ``25%``); None for
    anything else. Only regular expressions and :class:`fractions.Fraction` of the matched digits:
    nothing of the text is evaluated."""
    text = text.strip().rstrip(".").strip()
    lower = text.lower()
    for unit in _UNITS:
        if lower.endswith(unit):
            text = text[: len(text) - len(unit)].strip()
            break
    match = _NUMBER.match(text)
    if match is None:
        return None
    sign, body = match.groups()
    body = body.replace(" ", "")
    if "/" in body:
        num, den = body.split("/")
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
    else:
        value = Fraction(body)
    return -value if sign == "-" else value


@dataclass(frozen=True)
class Answer:
    """The answer of a problem and how a reply is checked against it.

    ``value`` is a :class:`~fractions.Fraction` (exact answers), a float (answers given to
    ``decimals`` places, e.g. a length with a square root) or a string (a label, compared
    case-insensitively; ``choices`` are the labels a reply may name, anything else is invalid).
    """

    value: Fraction | float | str
    decimals: int | None = None
    choices: tuple[str, ...] = ()

    @property
    def is_label(self) -> bool:
        return isinstance(self.value, str)

    @property
    def tolerance(self) -> float:
        """How far a numeric answer may be from ``value``: 0 for exact answers, half a unit of
        the last stated decimal place otherwise (plus a hair for binary rounding)."""
        return 0.0 if self.decimals is None else 0.5 * 10.0 ** -self.decimals + 1e-9

    def text(self) -> str:
        """The answer as written in the task's own replies (``gold_answer``)."""
        if isinstance(self.value, str):
            return self.value
        if self.decimals is not None:
            return f"{float(self.value):.{self.decimals}f}"
        value = Fraction(self.value)
        if value.denominator == 1:
            return str(value.numerator)
        decimal = float(value)
        return f"{decimal:g}" if Fraction(f"{decimal:g}") == value else f"{value.numerator}/{value.denominator}"

    def parse(self, content: str) -> tuple[Any, str | None]:
        """``(value, None)`` for an answer of this answer's kind, ``(None, why)`` for one that
        cannot be read as it (a word where a number is asked, a name the question does not allow)."""
        if self.is_label:
            word = content.strip().rstrip(".").strip().lower()
            if word not in {c.lower() for c in self.choices}:
                return None, f"Your answer {_shown(content)} is not one of the names this question allows."
            return word, None
        value = parse_number(content)
        if value is None:
            return None, f"Your answer {_shown(content)} is not a number (write it in digits: a whole number, a decimal or a fraction)."
        return value, None

    def check(self, parsed: Any) -> bool:
        """Whether a parsed answer is right (inside :func:`envs.answer_guard.guarded`)."""
        with guarded():
            if self.is_label:
                return parsed == str(self.value).lower()
            if self.decimals is None:
                return Fraction(parsed) == Fraction(self.value)
            return abs(float(parsed) - float(self.value)) <= self.tolerance

    def random_reply(self, rng: np.random.Generator) -> str:
        """A random well-formed answer of this answer's kind that never uses its value: a choice
        for labels, a number with as many digits (and decimals) otherwise."""
        if self.is_label:
            return f"<answer>{self.choices[int(rng.integers(len(self.choices)))]}</answer>"
        gold = self.text().lstrip("-")
        sign = "-" if self.text().startswith("-") and rng.random() < 0.5 else ""
        whole, _, frac = gold.partition(".")
        digits = "".join(str(int(d)) for d in rng.integers(0, 10, max(1, len(whole.split("/")[0]))))
        digits = digits.lstrip("0") or "0"
        if frac:
            digits += "." + "".join(str(int(d)) for d in rng.integers(0, 10, len(frac)))
        return f"<answer>{sign}{digits}</answer>"


def _shown(text: str, n: int = 30) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


@dataclass
class Problem:
    """One problem: its ``kind`` and ``params`` (what it is), and what the task derived from them."""

    kind: str
    params: dict[str, Any]
    answer: Answer
    #: The text twin's statement: the figure described in words, with its values.
    statement: str
    #: What the vision variant says of its picture: no value of the figure, and no digit at all.
    figure: str
    #: The question both variants ask (no value and no digit either).
    ask: str
    #: The values written on the figure (what the vision variant's text must not hold).
    given: tuple[float, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": self.params}

    @property
    def question(self) -> str:
        """The vision variant's text: what the figure shows and the question."""
        return f"{self.figure} {self.ask}"

    @property
    def text_question(self) -> str:
        """The text twin's: the figure in words and the question."""
        return f"{self.statement} {self.ask}"


class FigureQAEnv(MultiTurnEnv):
    """Base of the figure tasks: a problem with a picture, answered in ``<answer>...</answer>``.

    Subclasses set ``PRESETS`` (preset name -> the kinds it draws), ``topic`` and implement
    :meth:`draw_problem`, :meth:`build_problem` and :meth:`draw_figure` (their module's
    functions, as static methods).

    Args:
        preset: which problems are drawn (the subclass's ``PRESETS``).
        max_attempts: answers per episode; a wrong one with attempts left gets "not correct;
            try again" and reward 0, the last one ends the episode.
        max_turns: replies before truncation; default ``max_attempts + 1`` (one spare reply
            for an invalid one).
        image_size: the picture's ``(width, height)`` in pixels.
        picture: ``"own"`` (the default) or ``"another"``: each episode's picture is that of a
            second problem of the preset, drawn after the episode's own from the same seeded
            RNG, while the text and the answer stay the episode's (the check that a policy
            reads the picture, :class:`envs.capabilities.OtherPicture`). Vision tasks only.
    """

    PRESETS: ClassVar[dict[str, Any]] = {}
    DEFAULT_PRESET: ClassVar[str] = ""
    DEFAULT_ATTEMPTS: ClassVar[int] = 3
    DEFAULT_IMAGE_SIZE: ClassVar[tuple[int, int]] = (252, 252)
    #: The instructions' first words (``"Solve the geometry problem"``).
    topic: ClassVar[str] = "Solve the problem"

    def __init__(self, preset: str | None = None, *, max_attempts: int | None = None, max_turns: int | None = None,
                 format_penalty: float = -0.1, feedback: bool = True, render_mode: str | None = None,
                 image_size: Sequence[int] | None = None, picture: str = "own") -> None:
        preset = self.DEFAULT_PRESET if preset is None else preset
        if picture not in PICTURES or (picture != "own" and self.modality != "vision"):
            raise ValueError(f"picture must be one of {PICTURES} (another: vision tasks only), got {picture!r}")
        self.picture = picture
        self.decoy: Problem | None = None
        if preset not in self.PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(self.PRESETS)}")
        self.preset = preset
        self.max_attempts = self.DEFAULT_ATTEMPTS if max_attempts is None else int(max_attempts)
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        size = tuple(int(v) for v in (image_size if image_size is not None else self.DEFAULT_IMAGE_SIZE))
        if len(size) != 2 or not all(112 <= v <= 1024 for v in size):
            raise ValueError(f"image_size must be (width, height), each 112-1024 pixels, got {image_size!r}")
        self.image_size: tuple[int, int] = size  # type: ignore[assignment]
        super().__init__(max_turns=self.max_attempts + 1 if max_turns is None else max_turns,
                         format_penalty=format_penalty, render_mode=render_mode, feedback=feedback)
        self.problem = self.draw_problem(np.random.default_rng(0), self.preset)
        self._clear_episode()
        if self.modality == "vision":
            self.image_shape = (size[1], size[0], 3)
        self._build_spaces()

    client_kwargs: ClassVar = {**COMMON_CLIENT_KWARGS, "max_attempts": ClientKwarg(int, 1, 10),
                               "picture": ClientKwarg(str, choices=PICTURES)}

    @classmethod
    def other_picture_kwargs(cls) -> dict[str, Any]:
        """``{"picture": "another"}`` for the vision tasks (:class:`envs.capabilities.OtherPicture`)."""
        return {"picture": "another"} if cls.modality == "vision" else {}

    # -- what a subclass implements ---------------------------------------------------------------
    def draw_problem(self, rng: np.random.Generator, preset: str) -> Problem:
        raise NotImplementedError

    def build_problem(self, kind: str, params: dict[str, Any]) -> Problem:
        raise NotImplementedError

    def draw_figure(self, problem: Problem, size: tuple[int, int]) -> np.ndarray:
        raise NotImplementedError

    # -- the task ---------------------------------------------------------------------------------
    def _clear_episode(self) -> None:
        self.attempts = 0
        self.history: list[tuple[str, bool]] = []
        self._image: np.ndarray | None = None

    def _reset_task(self, options: dict[str, Any] | None) -> None:
        given = (options or {}).get("problem")
        if given is not None:
            if not isinstance(given, dict) or not isinstance(given.get("kind"), str) or \
                    not isinstance(given.get("params"), dict):
                raise ValueError("options['problem'] must be {'kind': str, 'params': dict}")
            self.problem = self.build_problem(given["kind"], dict(given["params"]))
        else:
            self.problem = self.draw_problem(self.np_random, self.preset)
        if self.picture == "another":
            self.decoy = self.draw_problem(self.np_random, self.preset)
        self._clear_episode()

    def instructions(self) -> str:
        where = "in the figure" if self.modality == "vision" else "in the text"
        tries = f" You have {number_word(self.max_attempts)} attempts." if self.max_attempts > 1 else ""
        return (f"{self.topic}; everything you need is {where}. You may reason first, then write only "
                f"the final answer between <answer> and </answer>.{tries}")

    def state_text(self) -> str:
        text = self.problem.question if self.modality == "vision" else self.problem.text_question
        if self.max_attempts > 1:
            text += f"\nAttempts left: {number_word(self.max_attempts - self.attempts)}."
        if self.modality == "vision":  # the picture last, right before the reply (as FrozenLake's board)
            text += f"\n{IMAGE_PLACEHOLDER}"
        return text

    def render_text(self) -> str:
        """The figure in words, its values included (the text twin's statement): what a vision
        task's picture shows, as ``envs.play`` prints it and as ``--reasoning state`` has the
        policy write it before answering."""
        return self.problem.statement

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        return free_answer(reply, MAX_ANSWER_CHARS)

    def apply_action(self, content: str) -> tuple[float, str, bool, bool]:
        """Check an answer: one attempt, whatever it holds. An answer that cannot be read as the
        question's kind (not a number, not one of the allowed names) is not correct, and the
        feedback says why (a reply's well-formedness does not depend on the problem: a tagged,
        non-empty answer of at most ``MAX_ANSWER_CHARS`` is a valid reply)."""
        self.attempts += 1
        value, unreadable = self.problem.answer.parse(content)
        correct = unreadable is None and self.problem.answer.check(value)
        self.history.append((content, correct))
        shown = _shown(content, 40)
        if correct:
            return 1.0, f"Your answer {shown} is correct.", True, True
        why = f"{unreadable[:-1]}; it" if unreadable else f"Your answer {shown}"
        if self.attempts < self.max_attempts:
            left = self.max_attempts - self.attempts
            return 0.0, (f"{why} is not correct; try again ({number_word(left)} attempt"
                         f"{'s' if left > 1 else ''} left)."), False, False
        return 0.0, f"{why} is not correct. The answer was {self.problem.answer.text()}.", True, False

    def sample_reply(self, rng: np.random.Generator) -> str:
        """A random well-formed answer of the answer's kind, never its value (a number with as
        many digits, or one of the allowed labels)."""
        return self.problem.answer.random_reply(rng)

    def outcome_text(self, terminated: bool, success: bool) -> str:
        """What an answer leads to (pretraining's dynamics target): ``correct`` or ``not correct``
        where it ends the episode; else the figure in words (:meth:`render_text`), which is also
        the target of pretraining's observe examples (``--pretrain-observe``: the picture ->
        its values, the perception a vision policy needs)."""
        if terminated:
            return "correct" if success else "not correct"
        return self.render_text()

    def task_info(self) -> dict[str, Any]:
        return {"preset": self.preset, "kind": self.problem.kind, "problem": copy.deepcopy(self.problem.to_dict()),
                "attempts": self.attempts, "gold_answer": self.problem.answer.text()}

    def render_image(self) -> np.ndarray:
        """The figure, uint8 (height, width, 3), drawn once per problem (a new array each call)."""
        if self._image is None:
            self._image = self.draw_figure(self.decoy or self.problem, self.image_size)
        return self._image.copy()


# -- drawing ----------------------------------------------------------------------------------------
#: Figures are drawn this many times larger and scaled down (smooth lines and letters).
SUPERSAMPLE = 2
INK = (20, 20, 20)
GIVEN_INK = (20, 60, 170)
ASK_INK = (200, 30, 30)


@lru_cache(maxsize=16)
def font(size: int) -> ImageFont.ImageFont:
    """Pillow's own font at ``size`` pixels (bundled with Pillow: no system font is needed)."""
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


class Canvas:
    """A white picture to draw a figure on, in figure coordinates (y up), scaled to fit.

    ``points`` are every point the figure uses; the transform fits their bounding box into the
    picture with ``margin`` pixels (of the final picture) on every side, keeping the aspect ratio.
    """

    def __init__(self, size: tuple[int, int], points: Sequence[tuple[float, float]] = (), margin: int = 34,
                 font_px: int = 13) -> None:
        self.s = SUPERSAMPLE
        self.size = size
        self.image = Image.new("RGB", (size[0] * self.s, size[1] * self.s), (255, 255, 255))
        self.draw = ImageDraw.Draw(self.image)
        self.font = font(font_px * self.s)
        if points:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            w, h = max(max(xs) - min(xs), 1e-9), max(max(ys) - min(ys), 1e-9)
            avail_w, avail_h = size[0] - 2 * margin, size[1] - 2 * margin
            self.scale = min(avail_w / w, avail_h / h) * self.s
            cx, cy = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
            self.offset = (size[0] * self.s / 2 - cx * self.scale, size[1] * self.s / 2 + cy * self.scale)
        else:
            self.scale, self.offset = float(self.s), (0.0, size[1] * self.s)

    def px(self, p: tuple[float, float]) -> tuple[float, float]:
        """A figure point's pixel position on the (supersampled) picture."""
        return (self.offset[0] + p[0] * self.scale, self.offset[1] - p[1] * self.scale)

    def line(self, a, b, width: int = 2, fill=INK, dash: int = 0) -> None:
        pa, pb = self.px(a), self.px(b)
        w = width * self.s
        if not dash:
            self.draw.line([pa, pb], fill=fill, width=w)
            return
        length = math.dist(pa, pb)
        step = dash * self.s
        n = max(1, int(length // step))
        for i in range(0, n, 2):
            t0, t1 = i / n, min(1.0, (i + 1) / n)
            self.draw.line([(pa[0] + (pb[0] - pa[0]) * t0, pa[1] + (pb[1] - pa[1]) * t0),
                            (pa[0] + (pb[0] - pa[0]) * t1, pa[1] + (pb[1] - pa[1]) * t1)], fill=fill, width=w)

    def polygon(self, points, width: int = 2, fill=INK) -> None:
        for a, b in zip(points, [*points[1:], points[0]]):
            self.line(a, b, width, fill)

    def circle(self, centre, radius: float, width: int = 2, fill=INK) -> None:
        x, y = self.px(centre)
        r = radius * self.scale
        self.draw.ellipse([x - r, y - r, x + r, y + r], outline=fill, width=width * self.s)

    def dot(self, p, radius: float = 2.5, fill=INK) -> None:
        x, y = self.px(p)
        r = radius * self.s
        self.draw.ellipse([x - r, y - r, x + r, y + r], fill=fill)

    def text_at_px(self, xy: tuple[float, float], text: str, fill=INK, box: bool = True) -> None:
        """``text`` centred on a (supersampled) pixel position, on a white box."""
        left, top, right, bottom = self.draw.textbbox((0, 0), text, font=self.font)
        w, h = right - left, bottom - top
        x, y = xy[0] - w / 2 - left, xy[1] - h / 2 - top
        if box:
            pad = 2 * self.s
            self.draw.rectangle([x + left - pad, y + top - pad, x + right + pad, y + bottom + pad], fill=(255, 255, 255))
        self.draw.text((x, y), text, fill=fill, font=self.font)

    def text(self, p, text: str, fill=INK, offset: tuple[float, float] = (0.0, 0.0), box: bool = True) -> None:
        """``text`` centred on figure point ``p`` moved by ``offset`` pixels (of the final picture; y up)."""
        x, y = self.px(p)
        self.text_at_px((x + offset[0] * self.s, y - offset[1] * self.s), text, fill, box)

    def label_away(self, p, away_from, text: str, distance: float = 11.0, fill=INK) -> None:
        """``text`` beside point ``p``, ``distance`` pixels on the side away from ``away_from``."""
        dx, dy = p[0] - away_from[0], p[1] - away_from[1]
        n = math.hypot(dx, dy) or 1.0
        self.text(p, text, fill, (dx / n * distance, dy / n * distance), box=False)

    def side_label(self, a, b, inside, text: str, distance: float = 12.0, fill=GIVEN_INK) -> None:
        """``text`` beside the middle of segment ``ab``, on the side away from point ``inside``."""
        mid = ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
        nx, ny = -(b[1] - a[1]), b[0] - a[0]
        n = math.hypot(nx, ny) or 1.0
        nx, ny = nx / n, ny / n
        if (inside[0] - mid[0]) * nx + (inside[1] - mid[1]) * ny > 0:
            nx, ny = -nx, -ny
        self.text(mid, text, fill, (nx * distance, ny * distance))

    def angle_mark(self, vertex, p1, p2, text: str | None = None, radius: float = 15.0, fill=GIVEN_INK,
                   text_distance: float = 30.0) -> None:
        """An arc in the angle ``p1 vertex p2`` (the smaller one), and ``text`` on its bisector."""
        v = self.px(vertex)
        a1 = math.degrees(math.atan2(self.px(p1)[1] - v[1], self.px(p1)[0] - v[0]))
        a2 = math.degrees(math.atan2(self.px(p2)[1] - v[1], self.px(p2)[0] - v[0]))
        diff = (a2 - a1) % 360
        if diff > 180:
            a1, diff = a2, 360 - diff
        r = radius * self.s
        self.draw.arc([v[0] - r, v[1] - r, v[0] + r, v[1] + r], a1, a1 + diff, fill=fill, width=2 * self.s)
        if text is not None:
            mid = math.radians(a1 + diff / 2)
            # a narrow angle's label sits further out, clear of both rays
            d = min(max(text_distance, 12.0 / max(math.sin(math.radians(diff / 2)), 1e-3)), 48.0) * self.s
            self.text_at_px((v[0] + d * math.cos(mid), v[1] + d * math.sin(mid)), text, fill)

    def right_angle(self, vertex, p1, p2, size: float = 9.0, fill=INK) -> None:
        """The small square that marks a right angle at ``vertex`` between the rays to ``p1`` and ``p2``."""
        v = self.px(vertex)
        u = [np.subtract(self.px(p), v) for p in (p1, p2)]
        u = [d / (np.linalg.norm(d) or 1.0) * size * self.s for d in u]
        a, c = (v[0] + u[0][0], v[1] + u[0][1]), (v[0] + u[1][0], v[1] + u[1][1])
        b = (v[0] + u[0][0] + u[1][0], v[1] + u[0][1] + u[1][1])
        self.draw.line([a, b, c], fill=fill, width=max(1, self.s))

    def finish(self) -> np.ndarray:
        """The picture at its final size, uint8 (height, width, 3)."""
        image = self.image.resize(self.size, Image.LANCZOS) if self.s != 1 else self.image
        return np.asarray(image, dtype=np.uint8)


def fmt(value: float | Fraction) -> str:
    """A given value as written on a figure and in the text twin: ``12``, ``7.5``."""
    value = float(value)
    return str(int(value)) if value == int(value) else f"{value:g}"


def choose(rng: np.random.Generator, items: Sequence[Any]) -> Any:
    """One of ``items``, uniformly (``rng.choice`` would turn tuples into arrays)."""
    return items[int(rng.integers(len(items)))]

