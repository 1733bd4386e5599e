"""Sokoban as a multi-turn task, observed as XSB text or as a rendered image.

Dynamics and rewards follow the common benchmark (gym-sokoban): -0.1 per move, +1 for a box
pushed onto a goal, -1 for a box pushed off one, +10 when every box is on a goal (the episode
then terminates with success). Walking into a wall or a blocked box is a valid move that
changes nothing; only unparsable replies are invalid.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np

from envs.base import COMMON_CLIENT_KWARGS, IMAGE_PLACEHOLDER, ClientKwarg, MultiTurnEnv, extract_tag
from envs.capabilities import direction_words, states_lookahead
from envs.sokoban.generator import generate_room
from envs.sokoban.render import BOX, BOX_ON_GOAL, FLOOR, GOAL, OUTSIDE, PLAYER, WALL, render_cells
from envs.sokoban.xsb import LevelCollection, LevelError, SokobanLevel, parse_xsb, reachable_cells

logger = logging.getLogger(__name__)

ACTIONS: tuple[str, ...] = ("Up", "Down", "Left", "Right")
_ACTION_INDEX = {name.lower(): i for i, name in enumerate(ACTIONS)}
#: Floor character of the text observation ("_" is XSB's alternative for floor; spaces are
#: easy to lose in tokenisation). ``render_mode="ansi"`` uses the standard space.
OBS_FLOOR = "_"
STEP_PENALTY, BOX_ON_REWARD, BOX_OFF_PENALTY, SOLVED_REWARD = -0.1, 1.0, -1.0, 10.0
#: Text board notations (``SokobanEnv(board=...)``).
BOARD_NOTATIONS = ("xsb", "spaced", "letters")
#: XSB cell -> the ``"letters"`` notation's letter (outside cells stay blank).
_LETTERS = {"#": "w", OBS_FLOOR: "f", ".": "o", "$": "b", "*": "d", "@": "p", "+": "P"}


@dataclass(frozen=True)
class SokobanPreset:
    """Room size (walls included), boxes, turn limit and the generator's solution-length cap."""

    size: tuple[int, int]
    num_boxes: int
    max_turns: int
    max_solution_moves: int


#: The optimal solution of every generated level needs at most ``max_solution_moves`` moves,
#: which leaves a few spare turns below ``max_turns`` for a mistake or two.
PRESETS: dict[str, SokobanPreset] = {
    "simple": SokobanPreset((6, 6), 1, max_turns=10, max_solution_moves=8),
    "hard": SokobanPreset((8, 8), 2, max_turns=25, max_solution_moves=20),
    "large": SokobanPreset((10, 10), 3, max_turns=40, max_solution_moves=30),
}
#: The fewest turns a loaded XSB level gets by default: gym-sokoban's Boxoban limit (120), which
#: the solutions of 10x10 Boxoban levels (up to ~110 moves) fit.
LOADED_LEVEL_MAX_TURNS = 120
#: Collections with at most this many levels are parsed and checked when the env is built;
#: larger ones are indexed and each level is parsed when first drawn.
VALIDATE_LEVELS_UP_TO = 2_000


def move_deltas(width: int) -> tuple[int, int, int, int]:
    """The flat-index step of each move in :data:`ACTIONS` order on a board ``width`` cells wide."""
    return (-width, width, -1, 1)


def blocked_move(walls: np.ndarray, boxes: np.ndarray, player: int, delta: int) -> str | None:
    """What stops the player at flat cell ``player`` from moving by ``delta`` cells (flat, row-major)
    on a board of ``walls`` and ``boxes`` (bool masks): ``"wall"``, ``"box"`` (a push against a
    wall or a second box), or None when the move changes the state."""
    target = player + delta
    if walls[target]:
        return "wall"
    if boxes[target] and (walls[target + delta] or boxes[target + delta]):
        return "box"
    return None


def lookahead_words(walls: np.ndarray, boxes: np.ndarray, player: int, width: int) -> str:
    """What each move in :data:`ACTIONS` order leads to: ``" Up wall Down move Left push Right
    blocked"`` (``wall``: steps into a wall; ``blocked``: a push against a wall or a second box;
    ``push``: pushes a box; ``move``: a step onto free floor or a goal)."""
    words = []
    for name, delta in zip(ACTIONS, move_deltas(width)):
        blocked = blocked_move(walls, boxes, player, delta)
        word = "wall" if blocked == "wall" else "blocked" if blocked else "push" if boxes[player + delta] else "move"
        words.append(f" {name} {word}")
    return "".join(words)


def aim_words(boxes: np.ndarray, goals: np.ndarray, player: int, width: int) -> str:
    """Where the work lies: ``" box Up Left goal Down"``, the nearest box off a goal seen from
    the player (Manhattan distance, the first in row-major order on a tie), then the nearest
    free goal seen from that box. ``" box none"`` once every box is on a goal."""
    def nearest(cells: np.ndarray, origin: int) -> int:
        r0, c0 = divmod(origin, width)
        return int(min(cells, key=lambda cell: abs(cell // width - r0) + abs(cell % width - c0)))

    loose, free = np.flatnonzero(boxes & ~goals), np.flatnonzero(goals & ~boxes)
    if not len(loose) or not len(free):
        return " box none"
    box = nearest(loose, player)
    player_rc, box_rc, goal_rc = (divmod(cell, width) for cell in (player, box, nearest(free, box)))
    return f" box{direction_words(player_rc, box_rc)} goal{direction_words(box_rc, goal_rc)}"


def subgoal_words(walls: np.ndarray, boxes: np.ndarray, goals: np.ndarray, player: int, width: int) -> str:
    """Where to stand next and which way to push from there: ``" stand Up Left push Right"``.
    The box and goal are :func:`aim_words`'; a push spot is the floor cell behind the box,
    opposite a direction of its goal (a push from it brings the box closer); the nearest spot
    to the player (Manhattan, the vertical push first on a tie) is seen from the player
    (``here`` when standing on it). Walls between are not planned around. ``" box none"`` once
    every box is on a goal; ``" stand none"`` when every spot is a wall or a box."""
    loose, free = np.flatnonzero(boxes & ~goals), np.flatnonzero(goals & ~boxes)
    if not len(loose) or not len(free):
        return " box none"

    def dist(a: int, b: int) -> int:
        return abs(a // width - b // width) + abs(a % width - b % width)

    box = int(min(loose, key=lambda cell: dist(cell, player)))
    goal = int(min(free, key=lambda cell: dist(cell, box)))
    deltas = dict(zip(ACTIONS, move_deltas(width)))
    pushes = direction_words(divmod(box, width), divmod(goal, width)).split()
    spots = [(box - deltas[d], d) for d in pushes if not walls[box - deltas[d]] and not boxes[box - deltas[d]]]
    if not spots:
        return " stand none"
    spot, push = min(spots, key=lambda s: dist(s[0], player))
    where = direction_words(divmod(player, width), divmod(spot, width)) or " here"
    return f" stand{where} push {push}"


def subgoal_moves(walls: np.ndarray, boxes: np.ndarray, goals: np.ndarray, player: int, width: int) -> list[str]:
    """The moves that do what :func:`subgoal_words` say, in :data:`ACTIONS` order: the push when
    the player stands on the push spot (``here``), else the plain steps (onto free floor or a
    goal, not a push) in a ``stand`` direction; empty where none does (``box none``, ``stand
    none``, or a named step into a wall: the words do not plan around walls)."""
    plan = subgoal_words(walls, boxes, goals, player, width).split()
    if plan[0] != "stand" or "push" not in plan:
        return []
    said = lookahead_words(walls, boxes, player, width).split()
    verdict = dict(zip(said[0::2], said[1::2]))
    where, push = plan[1:plan.index("push")], plan[-1]
    if where == ["here"]:
        return [push] if verdict[push] == "push" else []
    return [m for m in ACTIONS if m in where and verdict[m] == "move"]


def move_index(answer: str | None) -> int | None:
    """The index in :data:`ACTIONS` of the move an answer tag's content names (case and
    surrounding punctuation ignored, as the env reads it); None for no answer or no move."""
    if answer is None:
        return None
    return _ACTION_INDEX.get(answer.strip().strip(".!`'\"").strip().lower())


def _follows(plan: str, move: int | None) -> bool:
    """Whether move index ``move`` is what subgoal words ``plan`` name: the push when they say
    ``here``, else one of the ``stand`` directions."""
    if move is None or not plan.startswith("stand"):
        return False
    where, _, push = plan[len("stand"):].partition(" push ")
    named = [push.strip()] if where.strip() == "here" else where.split()
    return ACTIONS[move] in named


#: A letters-notation cell -> its XSB character.
_FROM_LETTERS = {"w": "#", "f": OBS_FLOOR, "o": ".", "b": "$", "d": "*", "p": "@", "P": "+"}


def parse_observed_board(observation: str) -> SokobanLevel | None:
    """The board of a text observation (the last ``Board:`` block, in any of
    :data:`BOARD_NOTATIONS`) as a level with its boxes and player; None where there is none."""
    _, sep, block = observation.rpartition("Board:\n")
    if not sep:
        return None
    rows = block.split("\n\n", 1)[0].split("\n")
    if all(len(r) % 2 == 0 and r[::2].strip() == "" for r in rows if r):  # one space before each cell
        rows = [r[1::2] for r in rows]
    rows = ["".join(_FROM_LETTERS.get(ch, ch) for ch in r) for r in rows]
    try:
        return parse_xsb("\n".join(rows))
    except LevelError:
        return None


_COLLECTIONS: dict[tuple[str, int, int], LevelCollection] = {}
_COLLECTIONS_LOCK = threading.Lock()


def shared_collection(path: str | Path) -> LevelCollection:
    """One :class:`LevelCollection` per file (and version of it) per process: a runner builds
    B x G envs of one task, which must not read and index the file B x G times. Collections of
    up to ``VALIDATE_LEVELS_UP_TO`` levels are checked completely when first opened."""
    resolved = Path(path).resolve()
    try:
        stat = resolved.stat()
        key = (str(resolved), stat.st_mtime_ns, stat.st_size)
    except OSError:
        return LevelCollection(path)  # raises the clear error for a missing file
    with _COLLECTIONS_LOCK:
        collection = _COLLECTIONS.get(key)
        if collection is None:
            collection = LevelCollection(resolved)
            if len(collection) <= VALIDATE_LEVELS_UP_TO:
                collection.validate()
            for old in [k for k in _COLLECTIONS if k[0] == key[0]]:  # an older version of the file
                del _COLLECTIONS[old]
            _COLLECTIONS[key] = collection
        return collection


def loaded_level_turns(level: SokobanLevel) -> int:
    """The default turn limit of a loaded level: ``max(120, 1.5 * floor cells * sqrt(boxes))``,
    so large levels with many boxes get room for their long solutions."""
    floor = int((~level.walls & ~level.outside).sum())
    return max(LOADED_LEVEL_MAX_TURNS, math.ceil(1.5 * floor * math.sqrt(level.num_boxes)))


class SokobanEnv(MultiTurnEnv):
    """Push every box onto a goal; the board is shown as XSB text.

    Levels are generated procedurally per ``reset`` (``preset``, default ``"simple"``, or
    ``size``/``num_boxes``), or taken from XSB: ``level`` (one level as a string) or
    ``levels_file`` (a collection, e.g. a Boxoban file; ``reset`` draws a level from its seed, or
    ``options={"level_index": i}`` picks the ``i``-th, counting from 0; ``info["level_label"]``
    is the file's own ``; N`` number). ``preset``, ``size`` and ``num_boxes`` describe generated
    rooms and are errors together with XSB levels. ``options={"level": xsb}`` plays that one
    level in any Sokoban env (the counterfactual probes' boards).

    Turn limits: a preset's own; for loaded levels :func:`loaded_level_turns` of each level
    (at least 120, gym-sokoban's Boxoban limit) unless ``max_turns`` is given.

    Large collections are indexed and parsed lazily (:class:`LevelCollection`); a malformed
    level met by a seeded draw is skipped (with a warning) for the next good one, while
    ``level_index`` naming it raises :class:`LevelError`. ``feedback=False``: observations after
    a step are the board alone (no move feedback or turns left).

    ``board``: the text board's notation. ``"xsb"`` (XSB with ``_`` for floor, the default);
    ``"spaced"``, XSB with a space before every cell (`` # # _ $ #``); ``"letters"``, one letter
    per cell after a space (`` w f o b d p P``: wall, floor, goal, box, box on a goal, you, you on
    a goal), each cell one token of the embedded tokenizer. Byte-level BPE merges runs of XSB
    (``######``, ``$_#``) into tokens whose meaning depends on the neighbouring cells;
    ``"letters"`` gives a tiny model a board whose cells sit at fixed token offsets, as
    FrozenLake's does (docs/results/sokoban.md#what-blocks-sokoban). ``render_text()`` is standard
    XSB in every notation.
    """

    modality: ClassVar[str] = "text"
    markov_state: ClassVar[bool] = True
    #: A served Sokoban's clients pick a preset and the notation, not a level file or a search budget.
    client_kwargs: ClassVar = {**COMMON_CLIENT_KWARGS, "preset": ClientKwarg(str, choices=tuple(PRESETS)),
                               "board": ClientKwarg(str, choices=tuple(sorted(BOARD_NOTATIONS)))}
    #: A step takes tens of microseconds; a reset may generate a room and the text calls may
    #: search, so those are the server's pool's.
    quick_calls: ClassVar = frozenset({"step"})

    def __init__(
        self,
        preset: str | None = None,
        *,
        size: int | tuple[int, int] | None = None,
        num_boxes: int | None = None,
        max_turns: int | None = None,
        max_solution_moves: int | None = None,
        level: str | None = None,
        levels_file: str | Path | None = None,
        format_penalty: float = -0.1,
        render_mode: str | None = None,
        feedback: bool = True,
        board: str = "xsb",
        tile_size: int = 28,
        search_budget: int = 30_000,
    ) -> None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown Sokoban preset {preset!r}; choose one of {sorted(PRESETS)}")
        p = PRESETS[preset or "simple"]
        self._levels: list[SokobanLevel] | LevelCollection | None = None
        self._bad_levels: set[int] = set()
        if level is not None and levels_file is not None:
            raise ValueError("pass either level= (one XSB string) or levels_file=, not both")
        if isinstance(tile_size, bool) or not isinstance(tile_size, (int, np.integer)) or tile_size < 4:
            raise ValueError(f"tile_size must be an integer number of pixels >= 4, got {tile_size!r}")
        if max_turns is not None and (isinstance(max_turns, bool) or int(max_turns) != max_turns or max_turns < 1):
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        self._auto_turns = False
        if level is not None or levels_file is not None:
            if size is not None or num_boxes is not None or preset is not None:
                raise ValueError("preset, size and num_boxes describe generated rooms; they cannot be combined "
                                 "with XSB levels (level= / levels_file=)")
            if level is not None:
                if not isinstance(level, str):
                    raise LevelError(f"level= must be one XSB level as a string, got {type(level).__name__}")
                self._levels = [parse_xsb(level)]
            else:
                self._levels = shared_collection(levels_file)  # type: ignore[arg-type]
            self._auto_turns = max_turns is None
            max_turns = LOADED_LEVEL_MAX_TURNS if max_turns is None else max_turns
        else:
            if num_boxes is not None and (isinstance(num_boxes, bool) or int(num_boxes) != num_boxes or num_boxes < 1):
                raise ValueError(f"num_boxes must be an integer >= 1, got {num_boxes!r}")
            if size is not None:
                dims = (size, size) if isinstance(size, (int, np.integer)) else tuple(size)
                if len(dims) != 2 or any(isinstance(d, bool) or int(d) != d or d < 4 for d in dims):
                    raise ValueError(f"size must be an integer >= 4 or (rows, cols) of such (walls included), got {size!r}")
                size = (int(dims[0]), int(dims[1]))
            boxes = int(num_boxes) if num_boxes is not None else p.num_boxes
            rows, cols = size if size is not None else p.size
            if boxes + 1 > (rows - 2) * (cols - 2) - 1:
                raise ValueError(f"{boxes} boxes do not fit a {rows}x{cols} room (walls included)")
            if int(search_budget) < 1:
                raise ValueError(f"search_budget must be >= 1, got {search_budget!r}")
        if isinstance(size, int):
            size = (size, size)
        self.size: tuple[int, int] = tuple(size) if size is not None else p.size  # type: ignore[assignment]
        self.num_boxes = int(num_boxes) if num_boxes is not None else p.num_boxes
        custom = size is not None or num_boxes is not None
        if max_turns is None:
            max_turns = self._default_turns() if custom else p.max_turns
        if max_solution_moves is None:
            cap = max(1, round(0.8 * max_turns)) if custom else p.max_solution_moves
            max_solution_moves = min(cap, max_turns)
        if max_solution_moves > max_turns:
            raise ValueError(
                f"max_solution_moves={max_solution_moves} exceeds max_turns={max_turns}: levels could be unsolvable in time"
            )
        super().__init__(max_turns=max_turns, format_penalty=format_penalty, render_mode=render_mode,
                         feedback=feedback)
        self.max_solution_moves = int(max_solution_moves)
        self.search_budget = int(search_budget)
        self.tile_size = int(tile_size)
        if board not in BOARD_NOTATIONS:
            raise ValueError(f"unknown Sokoban board notation {board!r}; choose one of {sorted(BOARD_NOTATIONS)}")
        self.board = board
        if isinstance(self._levels, LevelCollection):
            grid = (self._levels.max_height, self._levels.max_width)
        elif self._levels is not None:
            grid = (max(lv.height for lv in self._levels), max(lv.width for lv in self._levels))
        else:
            grid = self.size
        self.grid_shape: tuple[int, int] = grid
        self.image_shape = (grid[0] * self.tile_size, grid[1] * self.tile_size, 3)
        self.level: SokobanLevel | None = None
        self.optimal_moves: int | None = None
        self.level_index: int | None = None
        self.level_label: str | None = None
        self._boxes = np.zeros(0, dtype=bool)
        self._player = 0
        self._empty_board: tuple[str, list[str]] | None = None  # per level, see _xsb
        self._build_spaces()

    def _default_turns(self) -> int:
        """Turn limit for custom sizes, scaled like the presets: cells * sqrt(boxes) / 4, at least 10."""
        cells = self.size[0] * self.size[1]
        return max(10, int(round(cells * self.num_boxes ** 0.5 / 4)))

    # -- the task -----------------------------------------------------------------------
    def _reset_task(self, options: dict[str, Any] | None) -> None:
        options = options or {}
        if options.get("level") is not None:  # one given level (e.g. a counterfactual probe's board)
            text = options["level"]
            if not isinstance(text, str):
                raise LevelError(f"options['level'] must be one XSB level as a string, got {type(text).__name__}")
            self.level, self.optimal_moves, self.level_index, self.level_label = parse_xsb(text), None, None, None
            if self._auto_turns:
                self.max_turns = loaded_level_turns(self.level)
        elif self._levels is not None:
            n = len(self._levels)
            idx = options.get("level_index")
            if idx is not None:
                if isinstance(idx, bool) or int(idx) != idx or not 0 <= int(idx) < n:
                    raise ValueError(f"level_index {idx!r} out of range: the file has {n} levels, "
                                     f"indices 0 to {n - 1} in file order")
                self.level_index = int(idx)
                self.level = self._levels[self.level_index]  # a malformed level raises LevelError
            else:
                self.level_index, self.level = self._draw_level(int(self.np_random.integers(n)))
            self.optimal_moves = None
            self.level_label = self._levels.labels[self.level_index] if isinstance(self._levels, LevelCollection) \
                else str(self.level_index + 1)
            if self._auto_turns:
                self.max_turns = loaded_level_turns(self.level)
        else:
            room = generate_room(
                self.np_random,
                self.size[0],
                self.size[1],
                self.num_boxes,
                self.max_solution_moves,
                budget=self.search_budget,
            )
            self.level, self.optimal_moves, self.level_index = room.level, room.optimal_moves, None
        self._boxes = self.level.box_mask()
        self._player = self.level.player
        self._empty_board = None

    def _draw_level(self, start: int) -> tuple[int, SokobanLevel]:
        """Level ``start``, or the next well-formed one in file order (skipping malformed ones)."""
        assert self._levels is not None
        n = len(self._levels)
        for offset in range(n):
            idx = (start + offset) % n
            if idx in self._bad_levels:
                continue
            try:
                return idx, self._levels[idx]
            except LevelError as exc:
                self._bad_levels.add(idx)
                logger.warning("skipping a malformed level: %s", exc)
        raise LevelError(f"no well-formed level in {getattr(self._levels, 'path', 'the levels given')}")

    def instructions(self) -> str:
        return (
            "Sokoban: push every box onto a goal.\n"
            f"{self._legend()}\n"
            "Each turn you move one cell: Up, Down, Left or Right. Walking into a box pushes it one "
            "cell if the cell behind it is free (no wall or box); boxes cannot be pulled. Moving into "
            "a wall or a blocked box does nothing.\n"
            "Rewards: -0.1 per move, +1 for a box pushed onto a goal, -1 for a box pushed off a goal, "
            "+10 when every box is on a goal (you win).\n"
            f"You have {self.max_turns} moves. Reply with one move in answer tags, e.g. <answer>Up</answer>."
        )

    def _legend(self) -> str:
        if self.board == "letters":
            return ("Board legend: w wall, f floor, o goal, b box, d box on a goal, p you, P you on a goal. "
                    "Up is towards the first row.")
        return (
            f"Board legend: # wall, {OBS_FLOOR} floor, . goal, $ box, * box on a goal, "
            "@ you, + you on a goal. Up is towards the first row."
        )

    def state_text(self) -> str:
        return "Board:\n" + self._board()

    def _board(self) -> str:
        """The observation's board in the ``board`` notation."""
        board = self._xsb(OBS_FLOOR)
        if self.board == "xsb":
            return board
        table = _LETTERS if self.board == "letters" else None
        return "\n".join("".join(" " + (table.get(ch, ch) if table else ch) for ch in row) for row in board.split("\n"))

    def render_text(self) -> str:
        """The current board in standard XSB (space for floor)."""
        return self._xsb(" ")

    def _xsb(self, floor: str) -> str:
        assert self.level is not None, "call reset() first"
        if self._empty_board is None or self._empty_board[0] != floor:
            # The board without boxes and player, as a list of cells (built once per level).
            lv = self.level
            empty = lv.to_xsb(np.zeros(lv.height * lv.width, dtype=bool), player=-1, floor=floor)
            cells = [ch for row in empty.split("\n") for ch in row.ljust(lv.width)]
            self._empty_board = (floor, cells)
        cells = list(self._empty_board[1])
        goals, width = self.level.goals, self.level.width
        for b in np.flatnonzero(self._boxes).tolist():
            cells[b] = "*" if goals[b] else "$"
        cells[self._player] = "+" if goals[self._player] else "@"
        return "\n".join("".join(cells[i : i + width]).rstrip() for i in range(0, len(cells), width))

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        content = extract_tag(reply)
        if content is None:
            return None, "no <answer>...</answer> found; reply with one move, e.g. <answer>Up</answer>"
        move = move_index(content)
        if move is None:
            shown = content if len(content) <= 40 else content[:40] + "..."
            return None, f"{shown!r} is not a move; answer with one of Up, Down, Left, Right"
        return move, None

    def _delta(self, action: int) -> int:
        return move_deltas(self.level.width)[action]

    def _blocked(self, action: int) -> str | None:
        """What stops ``action``: ``"wall"``, ``"box"`` (a push against a wall or a second box),
        or None when the move changes the state."""
        return blocked_move(self.level.walls, self._boxes, self._player, self._delta(action))

    def apply_action(self, action: int) -> tuple[float, str, bool, bool]:
        assert self.level is not None, "call reset() first"
        delta = self._delta(action)
        name = ACTIONS[action]
        goals, boxes = self.level.goals, self._boxes
        target = self._player + delta
        on_before = int((boxes & goals).sum())
        blocked = self._blocked(action)
        if blocked == "wall":
            feedback = f"You moved {name} into a wall; nothing changed."
        elif blocked == "box":
            feedback = f"The box {name} of you is blocked; nothing changed."
        elif boxes[target]:
            boxes[target], boxes[target + delta] = False, True
            self._player = target
            feedback = f"You pushed a box {name}."
        else:
            self._player = target
            feedback = f"You moved {name}."
        on_after = int((boxes & goals).sum())
        reward = STEP_PENALTY
        if on_after > on_before:
            reward += BOX_ON_REWARD * (on_after - on_before)
            feedback += " A box is now on a goal."
        elif on_after < on_before:
            reward += BOX_OFF_PENALTY * (on_before - on_after)
            feedback += " A box left its goal."
        solved = on_after == self.level.num_boxes
        if solved:
            reward += SOLVED_REWARD
            feedback += " Every box is on a goal: solved!"
        return reward, feedback, solved, solved

    def task_info(self) -> dict[str, Any]:
        on_goals = int((self._boxes & self.level.goals).sum()) if self.level is not None else 0
        return {
            "boxes_on_goals": on_goals,
            "num_boxes": self.level.num_boxes if self.level is not None else self.num_boxes,
            "optimal_moves": self.optimal_moves,
            "level_index": self.level_index,
            "level_label": self.level_label,
        }

    def cell_codes(self) -> np.ndarray:
        """The current board as render cell codes, (rows, cols) int."""
        assert self.level is not None, "call reset() first"
        lv = self.level
        codes = np.full(lv.height * lv.width, FLOOR, dtype=np.intp)
        codes[lv.outside] = OUTSIDE
        codes[lv.goals] = GOAL
        codes[self._boxes] = BOX
        codes[self._boxes & lv.goals] = BOX_ON_GOAL
        codes[lv.walls] = WALL
        codes[self._player] = PLAYER + int(lv.goals[self._player])
        return codes.reshape(lv.height, lv.width)

    def render_image(self) -> np.ndarray:
        """The board as uint8 RGB, ``tile_size`` px per cell, padded to ``image_shape``."""
        return render_cells(self.cell_codes(), self.tile_size, self.grid_shape)

    def outcome_text(self, terminated: bool, success: bool) -> str:
        """``solved``, or the board after the move in the observation's notation (``_`` floor):
        the dynamics pretraining target."""
        if terminated:
            return "solved" if success else "failure"
        return self._board()

    # -- helpers for agents and training ------------------------------------------------
    @staticmethod
    def legal_actions() -> list[str]:
        """Every move name; all are always legal (a blocked move is a no-op, not an error)."""
        return list(ACTIONS)

    def effective_actions(self) -> list[str]:
        """The moves that change the state: not into a wall, not a push against a wall or a
        second box (every move if none does, which no valid level allows). Random replies and
        the pretraining's replies draw from these, so imitating them needs the board."""
        assert self.level is not None, "call reset() first"
        return [name for index, name in enumerate(ACTIONS) if self._blocked(index) is None] or list(ACTIONS)

    def lookahead_text(self) -> str:
        """What each move leads to, in action order: ``" Up wall Down move Left push Right
        blocked"`` (``wall``: steps into a wall; ``blocked``: a push against a wall or a second
        box; ``push``: pushes a box; ``move``: a step onto free floor or a goal)."""
        assert self.level is not None, "call reset() first"
        return lookahead_words(self.level.walls, self._boxes, self._player, self.level.width)

    def aim_text(self) -> str:
        """Where the work lies: ``" box Up Left goal Down"``, the nearest box off a goal seen
        from the player, then the nearest free goal seen from that box (:func:`aim_words`). It
        says where things are, not which move is good: reaching the box's far side and pushing
        is left to the policy."""
        assert self.level is not None, "call reset() first"
        return aim_words(self._boxes, self.level.goals, self._player, self.level.width)

    def subgoal_text(self) -> str:
        """Where to stand next and which way to push from there (:func:`subgoal_words`):
        ``" stand Up Left push Right"``. It describes the state; the pretraining pairs it with
        random moves, so following it is left to RL, or to a follow stage (:meth:`subgoal_moves`)."""
        assert self.level is not None, "call reset() first"
        return subgoal_words(self.level.walls, self._boxes, self.level.goals, self._player, self.level.width)

    def subgoal_moves(self) -> list[str]:
        """The moves that do what :meth:`subgoal_text` says (:func:`subgoal_moves`): the push on
        the push spot, else a plain step in a ``stand`` direction; empty where none does."""
        assert self.level is not None, "call reset() first"
        return subgoal_moves(self.level.walls, self._boxes, self.level.goals, self._player, self.level.width)

    @classmethod
    def turn_diagnostics(cls, turns: Sequence[tuple[str, str]]) -> dict[str, float]:
        """Over every turn whose observation shows a board: ``noop_moves`` (valid moves played)
        and ``noop_rate``, the share of them that changed nothing (into a wall or a blocked box;
        0 for a policy that looks where it steps; NaN with no valid move). Where replies write a
        lookahead (reasoning ``lookahead``, ``aim`` or ``subgoal``), also ``lookahead_turns`` and
        ``lookahead_exact``: how often the think tag ends by naming what all four moves lead to;
        where they write the aim first (reasoning ``aim``), also ``aim_turns`` and
        ``aim_exact``: how often the think tag's opening words place the box and goal right;
        where they write the subgoal first (reasoning ``subgoal``), ``subgoal_turns`` and
        ``subgoal_exact`` likewise, ``subgoal_followed``: how often the move is the one the right
        words name (the push on the spot, else a step named in the ``stand`` words), and
        ``subgoal_obeyed``: how often it is the one the reply's own words name, right or wrong
        (the link from the words to the move)."""
        moves = noops = thought = exact = aimed = aim_exact = planned = plan_exact = followed = obeyed = 0
        parsed: dict[str, SokobanLevel | None] = {}
        for observation, reply in turns:
            if observation not in parsed:
                parsed[observation] = parse_observed_board(observation or "")
            level = parsed[observation]
            if level is None or not isinstance(reply, str):
                continue
            boxes = level.box_mask()
            think, move = extract_tag(reply, "think"), move_index(extract_tag(reply))
            if think is not None:
                thought += 1
                exact += states_lookahead(think, lookahead_words(level.walls, boxes, level.player, level.width).strip())
                if think.startswith("box"):
                    aimed += 1
                    aim = aim_words(boxes, level.goals, level.player, level.width).strip()
                    aim_exact += think.startswith(aim + ",")
                elif think.startswith("stand"):
                    planned += 1
                    plan = subgoal_words(level.walls, boxes, level.goals, level.player, level.width).strip()
                    plan_exact += think.startswith(plan + ",")
                    followed += _follows(plan, move)
                    obeyed += _follows(think.split(",")[0].strip(), move)
            if move is None:
                continue
            moves += 1
            noops += blocked_move(level.walls, boxes, level.player, move_deltas(level.width)[move]) is not None
        out = {"noop_moves": float(moves), "noop_rate": noops / moves if moves else math.nan}
        if thought:
            out.update(lookahead_turns=float(thought), lookahead_exact=exact / thought)
        if aimed:
            out.update(aim_turns=float(aimed), aim_exact=aim_exact / aimed)
        if planned:
            out.update(subgoal_turns=float(planned), subgoal_exact=plan_exact / planned,
                       subgoal_followed=followed / planned, subgoal_obeyed=obeyed / planned)
        return out

    def counterfactual_probes(self, rng: np.random.Generator, n: int) -> list[tuple[dict, dict, str]]:
        """Pairs of boards that differ in one cell next to the player: a wall in state a, plain
        floor in state b, so the move towards it does nothing in a and moves in b. A policy that
        looks where it steps takes that move more in b (0 for a board-blind policy). Boards are
        the task's own starting boards (generated rooms, or levels drawn from the file); a wall
        that would cut off part of the room is not used."""
        probes: list[tuple[dict, dict, str]] = []
        for _ in range(20 * n):
            if len(probes) >= n:
                break
            if self._levels is not None:
                try:
                    level = self._levels[int(rng.integers(len(self._levels)))]
                except LevelError:
                    continue
            else:
                level = generate_room(rng, self.size[0], self.size[1], self.num_boxes, self.max_solution_moves,
                                      budget=self.search_budget).level
            open_board = level.to_xsb()
            deltas = move_deltas(level.width)
            open_reach = int(reachable_cells(level.walls, level.height, level.width, level.player).sum())
            boxes = level.box_mask()
            for action in rng.permutation(len(ACTIONS)).tolist():
                target = level.player + deltas[action]
                if level.walls[target] or level.goals[target] or boxes[target]:
                    continue
                walls = level.walls.copy()
                walls[target] = True
                reach = reachable_cells(walls, level.height, level.width, level.player)
                if reach is None or int(reach.sum()) != open_reach - 1:
                    continue  # the wall would cut the room in two: more than one detail changes
                if all(blocked_move(walls, boxes, level.player, d) for d in deltas):
                    continue  # the player would be stuck: every move a no-op in state a
                walled = SokobanLevel(level.height, level.width, walls, level.goals, level.boxes, level.player,
                                      level.outside).to_xsb()
                probes.append(({"level": walled}, {"level": open_board}, ACTIONS[action]))
                break
        return probes

    @staticmethod
    def format_reply(action: str) -> str:
        """The canonical reply for a move name, e.g. ``"<answer>Up</answer>"``."""
        key = action.strip().lower()
        if key not in _ACTION_INDEX:
            raise ValueError(f"unknown Sokoban move {action!r}; expected one of {list(ACTIONS)}")
        return f"<answer>{ACTIONS[_ACTION_INDEX[key]]}</answer>"


class SokobanVisionEnv(SokobanEnv):
    """Sokoban observed as an image (same dynamics and seeds as :class:`SokobanEnv`)."""

    modality: ClassVar[str] = "vision"
    #: Every observation is a picture to encode as PNG: the server's pool answers.
    quick_calls: ClassVar = frozenset()

    def _legend(self) -> str:
        return (
            "The board is the image: brown bricks are walls, beige is floor, red rings are goals, "
            "orange crossed squares are boxes (green once on a goal), the blue disc is you. "
            "Up is towards the top of the image."
        )

    def state_text(self) -> str:
        return "Board:\n" + IMAGE_PLACEHOLDER


__all__ = ["ACTIONS", "PRESETS", "SokobanEnv", "SokobanPreset", "SokobanVisionEnv", "LevelError"]
