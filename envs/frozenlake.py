"""FrozenLake as a multi-turn text task and as a vision task (Pillow-drawn board).

Dynamics are gymnasium's ``FrozenLake-v1``: actions Left/Down/Right/Up (0..3), a move off the
board keeps the agent in place, a hole ends the episode (reward 0, failure), the goal ends it
(reward 1, success). With ``is_slippery=True`` the agent moves in the intended direction with
probability 1/3 and in each perpendicular direction with 1/3, drawn exactly as gymnasium draws
it (one ``np_random.random()`` per step over ``[(a-1)%4, a, (a+1)%4]``).

Unless a fixed map is given (``desc`` or ``map_name``), every ``reset`` draws a new random map
from the seeded RNG with gymnasium's ``generate_random_map`` algorithm (each cell frozen with
probability ``p``, redrawn until the goal is reachable).

Text notation (``render_mode="ansi"`` and the observation): one row per line, cells separated
by spaces: ``P`` player, ``S`` start, ``F`` frozen, ``H`` hole, ``G`` goal; ``P`` is drawn over
whatever cell the player stands on.

Replies: ``<answer>Down</answer>``; the action name is case-insensitive and may be abbreviated
to its first letter (``<answer>d</answer>``). Anything else is an invalid reply.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
from PIL import Image, ImageDraw

from envs.base import COMMON_CLIENT_KWARGS, IMAGE_PLACEHOLDER, ClientKwarg, MultiTurnEnv, extract_tag
from envs.capabilities import direction_words, states_lookahead

ACTIONS = ("Left", "Down", "Right", "Up")
LEFT, DOWN, RIGHT, UP = range(4)
_MOVES = {LEFT: (0, -1), DOWN: (1, 0), RIGHT: (0, 1), UP: (-1, 0)}
_ACTION_BY_WORD = {**{a.lower(): i for i, a in enumerate(ACTIONS)}, **{a[0].lower(): i for i, a in enumerate(ACTIONS)}}

#: gymnasium's fixed maps.
MAPS: dict[str, list[str]] = {
    "4x4": ["SFFF", "FHFH", "FFFH", "HFFG"],
    "8x8": [
        "SFFFFFFF",
        "FFFFFFFF",
        "FFFHFFFF",
        "FFFFFHFF",
        "FFFHFFFF",
        "FHHFFFHF",
        "FHFFHFHF",
        "FFFHFFFG",
    ],
}

# gymnasium's slippery probabilities, computed the same way so that draws match bit for bit.
_SUCCESS = 1.0 / 3.0
_FAIL = (1.0 - _SUCCESS) / 2.0
_SLIP_CDF = np.cumsum([_FAIL, _SUCCESS, _FAIL])

TILE = 28  # pixels per cell: one Qwen2-VL visual token per tile
#: One row of the board text (:meth:`FrozenLakeEnv.board_text`), stripped: cells separated by spaces.
_BOARD_ROW = re.compile(r"^[SFHGP]( [SFHGP])+$")


def goal_reachable(board: np.ndarray) -> bool:
    """Whether a path of non-hole cells joins the top-left start to a goal (4-neighbour moves)."""
    nrow, ncol = board.shape
    seen = {(0, 0)}
    frontier = [(0, 0)]
    while frontier:
        r, c = frontier.pop()
        for dr, dc in _MOVES.values():
            rr, cc = r + dr, c + dc
            if 0 <= rr < nrow and 0 <= cc < ncol and (rr, cc) not in seen:
                if board[rr, cc] == "G":
                    return True
                if board[rr, cc] != "H":
                    seen.add((rr, cc))
                    frontier.append((rr, cc))
    return False


def parse_board(text: str) -> list[list[str]] | None:
    """The last board (rows of space-separated ``S F H G P`` cells, any size) in an observation
    text, as rows of cells; None when the text holds none (e.g. a vision observation)."""
    blocks: list[list[str]] = []
    current: list[str] = []
    for line in text.splitlines():
        if _BOARD_ROW.match(line.strip()):
            current.append(line.strip())
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    if not blocks:
        return None
    rows = [r.split(" ") for r in blocks[-1]]
    return rows if all(len(r) == len(rows[0]) for r in rows) else None


#: Redraws ``random_map`` makes before giving up (settings that pass
#: :func:`check_map_settings` find a map within a few thousand draws at worst).
MAX_MAP_DRAWS = 100_000
#: Draws :func:`check_map_settings` tries before rejecting ``size``/``p``.
SETTINGS_PROBE_DRAWS = 2_000


class MapGenerationError(ValueError):
    """No solvable random map could be drawn for these settings (``p`` too low for ``size``)."""


def random_map(rng: np.random.Generator, size: int = 4, p: float = 0.8, *,
               max_draws: int = MAX_MAP_DRAWS) -> list[str]:
    """A random solvable map, drawn from ``rng`` exactly as gymnasium's ``generate_random_map``.

    Given a generator in the same state, this returns the same map as
    ``gymnasium.envs.toy_text.frozen_lake.generate_random_map(size, p, seed)``. Unlike it, the
    redraws are bounded: after ``max_draws`` unsolvable maps it raises
    :class:`MapGenerationError` instead of looping forever (``p=0.05`` on 8x8 has a path with
    probability ~1e-17).
    """
    if size < 2:
        raise ValueError(f"FrozenLake size must be >= 2, got {size}")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"frozen probability p must be in (0, 1], got {p}")
    for _ in range(max_draws):
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        board[0][0] = "S"
        board[-1][-1] = "G"
        if goal_reachable(board):
            return ["".join(row) for row in board]
    raise MapGenerationError(
        f"no {size}x{size} FrozenLake map with a path from S to G in {max_draws} draws at p={p}; "
        "raise p (the probability that a cell is frozen) or lower size")


@lru_cache(maxsize=64)
def check_map_settings(size: int, p: float) -> None:
    """Reject ``size``/``p`` for which solvable maps are too rare to draw (a clear error at
    construction instead of a reset that never returns): some map within
    ``SETTINGS_PROBE_DRAWS`` draws must have a path."""
    try:
        random_map(np.random.default_rng(0), size, p, max_draws=SETTINGS_PROBE_DRAWS)
    except MapGenerationError:
        raise MapGenerationError(
            f"FrozenLake settings size={size}, p={p} almost never give a solvable map (none in "
            f"{SETTINGS_PROBE_DRAWS} draws); raise p (the probability that a cell is frozen) or lower size"
        ) from None


class FrozenLakeEnv(MultiTurnEnv):
    """Walk from ``S`` to ``G`` on a frozen lake without falling into a hole ``H``.

    Args:
        size: side of the random maps (ignored when ``desc`` or ``map_name`` is given).
        p: probability that a random cell is frozen.
        desc: a fixed map, rows of ``S``/``F``/``H``/``G`` (gymnasium's format).
        map_name: one of gymnasium's fixed maps (``"4x4"``, ``"8x8"``).
        is_slippery: gymnasium's slippery dynamics (1/3 intended, 1/3 each perpendicular).
        max_turns: turn limit; default ``nrow + ncol`` (8 on 4x4: the 6-move path plus 2).
        format_penalty: reward of an invalid reply.
        hole_reward: reward of falling into a hole (gymnasium's 0 by default). Success is
            still reaching the goal; a negative value tells a fall from a walk that runs out of
            turns, which the default scores the same.
        render_mode: ``"ansi"`` (the board text) or ``"rgb_array"`` (the board image).
        feedback: include the move feedback and turns left in observations after a step;
            ``False``: the board alone.
    """

    markov_state: ClassVar[bool] = True
    #: A served lake's clients may choose its size up to 12x12 (a map and its image stay small).
    client_kwargs: ClassVar = {**COMMON_CLIENT_KWARGS, "size": ClientKwarg(int, 2, 12), "p": ClientKwarg(float, 0.5, 1.0),
                               "map_name": ClientKwarg(str, choices=tuple(MAPS)), "is_slippery": ClientKwarg(bool),
                               "hole_reward": ClientKwarg(float, -1.0, 1.0)}
    #: A step, a reset (a map of at most 12x12) and the text calls take tens of microseconds.
    quick_calls: ClassVar = frozenset({"reset", "step", "call"})

    def __init__(
        self,
        size: int = 4,
        *,
        p: float = 0.8,
        desc: list[str] | None = None,
        map_name: str | None = None,
        is_slippery: bool = False,
        max_turns: int | None = None,
        format_penalty: float = -0.1,
        hole_reward: float = 0.0,
        render_mode: str | None = None,
        feedback: bool = True,
    ) -> None:
        if desc is None and map_name is not None:
            if map_name not in MAPS:
                raise ValueError(f"unknown map_name {map_name!r}; choose one of {sorted(MAPS)} or pass desc=[...]")
            desc = MAPS[map_name]
        self.fixed_map = _check_desc(desc) if desc is not None else None
        self.size = int(size)
        self.p = float(p)
        if self.fixed_map is None and self.size < 2:
            raise ValueError(f"FrozenLake size must be >= 2, got {size}")
        if not 0.0 < self.p <= 1.0:
            raise ValueError(f"frozen probability p must be in (0, 1], got {p}")
        if self.fixed_map is None:
            check_map_settings(self.size, self.p)
        self.nrow, self.ncol = (len(desc), len(desc[0])) if desc is not None else (self.size, self.size)
        self.is_slippery = bool(is_slippery)
        self.hole_reward = float(hole_reward)
        if not np.isfinite(self.hole_reward):
            raise ValueError(f"hole_reward must be a finite number, got {hole_reward}")
        super().__init__(
            max_turns=max_turns if max_turns is not None else self.nrow + self.ncol,
            format_penalty=format_penalty,
            render_mode=render_mode,
            feedback=feedback,
        )
        # Until the first reset: the fixed map, or an all-frozen board of the right size.
        n = self.size
        blank = ["S" + "F" * (n - 1)] + ["F" * n] * (n - 2) + ["F" * (n - 1) + "G"]
        self.desc: list[str] = list(self.fixed_map) if self.fixed_map else blank
        self.pos = (0, 0)
        self._set_start()
        if self.modality == "vision":
            self.image_shape = (self.nrow * TILE, self.ncol * TILE, 3)
        self._build_spaces()

    # -- the task -----------------------------------------------------------------------
    def _set_start(self) -> None:
        starts = [(r, c) for r, row in enumerate(self.desc) for c, ch in enumerate(row) if ch == "S"]
        self.pos = starts[0] if starts else (0, 0)

    def _reset_task(self, options: dict[str, Any] | None) -> None:
        if options and "desc" in options:
            self.desc = _check_desc(options["desc"], (self.nrow, self.ncol))
        elif self.fixed_map is not None:
            self.desc = list(self.fixed_map)
        else:
            self.desc = random_map(self.np_random, self.size, self.p)
        self._set_start()
        if options and options.get("position") is not None:
            r, c = (int(v) for v in options["position"])
            if not (0 <= r < self.nrow and 0 <= c < self.ncol) or self.desc[r][c] in "HG":
                raise ValueError(f"options['position'] {[r, c]} is off the board or on a hole or the goal")
            self.pos = (r, c)

    def instructions(self) -> str:
        return (
            "FrozenLake: move the player P to the goal G; F is frozen ice, stepping on a hole H "
            "loses. Reply with one move: <answer>Left|Down|Right|Up</answer>."
        )

    def board_text(self) -> str:
        """The board in the documented notation: one line per row, every cell preceded by a
        space (``P`` over the player's cell), e.g. ``" P F H F"``.

        The space before the first cell makes each cell kind one and the same token in
        byte-level BPE vocabularies (``" F"`` whatever its column, where a bare ``"F"`` after
        a newline would be another token), which makes the board easier to learn to read.
        """
        rows = []
        for r, row in enumerate(self.desc):
            rows.append("".join(" P" if (r, c) == self.pos else " " + ch for c, ch in enumerate(row)))
        return "\n".join(rows)

    def state_text(self) -> str:
        return self.board_text()

    def render_text(self) -> str:
        return self.board_text()

    def parse_action(self, reply: str) -> tuple[Any, str | None]:
        content = extract_tag(reply)
        if content is None:
            return None, "no <answer>...</answer> found; reply like <answer>Down</answer>."
        action = _ACTION_BY_WORD.get(content.lower())
        if action is None:
            shown = content if len(content) <= 20 else content[:20] + "..."
            return None, f"{shown!r} is not a move; answer one of Left, Down, Right, Up."
        return action, None

    def apply_action(self, action: int) -> tuple[float, str, bool, bool]:
        moved = action
        if self.is_slippery:  # gymnasium's categorical_sample over [(a-1)%4, a, (a+1)%4]
            branch = int(np.argmax(_SLIP_CDF > self.np_random.random()))
            moved = ((action - 1) % 4, action, (action + 1) % 4)[branch]
        r, c = self._target(self.pos, moved)
        stayed = (r, c) == self.pos
        self.pos = (r, c)
        cell = self.desc[r][c]
        if moved != action:
            feedback = f"You tried {ACTIONS[action]} but slipped {ACTIONS[moved]}."
        elif stayed:
            feedback = f"{ACTIONS[action]} hits the edge; you stay."
        else:
            feedback = f"You moved {ACTIONS[action]}."
        if cell == "H":
            return self.hole_reward, feedback + " You fell into a hole.", True, False
        if cell == "G":
            return 1.0, feedback + " You reached the goal!", True, True
        return 0.0, feedback, False, False

    def _target(self, pos: tuple[int, int], action: int) -> tuple[int, int]:
        dr, dc = _MOVES[action]
        return min(max(pos[0] + dr, 0), self.nrow - 1), min(max(pos[1] + dc, 0), self.ncol - 1)

    def legal_actions(self) -> list[str]:
        """The moves whose intended step stays on the board (for format warm-up replies)."""
        return [ACTIONS[a] for a in range(4) if self._target(self.pos, a) != self.pos]

    def lookahead_text(self) -> str:
        """The cell each move steps on, in action order: ``" Left - Down F Right H Up -"``
        (``-`` where the move would leave the board; the letters of the board notation)."""
        return _lookahead(self.desc, self.pos)

    def aim_text(self) -> str:
        """Where the goal lies seen from the player: ``" goal Down Right"`` (the vertical word
        first; reasoning mode ``aim`` writes it before the lookahead)."""
        goal = next((r, row.index("G")) for r, row in enumerate(self.desc) if "G" in row)
        return " goal" + direction_words(self.pos, goal)

    @staticmethod
    def format_reply(action: int | str) -> str:
        """The canonical reply for an action index or name, e.g. ``"<answer>Down</answer>"``."""
        index = action if isinstance(action, (int, np.integer)) else _ACTION_BY_WORD.get(str(action).strip().lower())
        if index is None or not 0 <= int(index) < 4:
            raise ValueError(f"unknown FrozenLake action {action!r}; use 0-3 or one of {ACTIONS}")
        return f"<answer>{ACTIONS[int(index)]}</answer>"

    def task_info(self) -> dict[str, Any]:
        return {"position": list(self.pos), "map": list(self.desc)}

    def outcome_text(self, terminated: bool, success: bool) -> str:
        """``goal``, ``hole``, or the board after the move (the dynamics pretraining target)."""
        if terminated:
            return "goal" if success else "hole"
        return self.board_text()

    def counterfactual_probes(self, rng: np.random.Generator, n: int) -> list[tuple[dict, dict, str]]:
        """Boards where P has ice both below and to the right, except that one of the two is a
        hole: state a has the hole below, state b to the right, so a policy that looks where
        it steps prefers Down more in b (the hole-reading probe; 0 for a board-blind policy)."""
        probes: list[tuple[dict, dict, str]] = []
        for _ in range(50 * n):
            if len(probes) >= n:
                break
            desc = [list(row) for row in random_map(rng, self.nrow, self.p)] if self.fixed_map is None \
                else [list(row) for row in self.fixed_map]
            r, c = int(rng.integers(self.nrow - 1)), int(rng.integers(self.ncol - 1))
            if desc[r][c] in "HG" or desc[r + 1][c] == "G" or desc[r][c + 1] == "G":
                continue
            a, b = [row[:] for row in desc], [row[:] for row in desc]
            a[r + 1][c], a[r][c + 1] = "H", "F"
            b[r + 1][c], b[r][c + 1] = "F", "H"
            probes.append(({"desc": ["".join(x) for x in a], "position": [r, c]},
                           {"desc": ["".join(x) for x in b], "position": [r, c]}, "Down"))
        return probes

    @classmethod
    def turn_diagnostics(cls, turns: Sequence[tuple[str, str]]) -> dict[str, float]:
        """The safe-move probe: how often the policy takes the safe move where exactly one of
        Down/Right is a hole.

        Over every turn whose observation shows a board (any size; vision observations show
        none and are skipped) with exactly one player, where both Down and Right stay on the
        board and exactly one of them leads into a hole, it counts replies naming Down or Right
        and the fraction that chose the safe one: 0.5 is what a board-blind Down/Right habit
        scores (docs/design.md). Other replies (other moves, invalid replies) are counted
        apart. A reply is read as the env reads it (the last complete answer tag), so the move
        counted is the move the env executed.

        Returns ``probe_states`` (qualifying turns), ``probe_down_right`` (of those, replies of
        Down or Right) and ``probe_safe_rate`` (NaN when there were none). Where replies write a
        lookahead (reasoning ``lookahead`` or ``aim``), also ``lookahead_turns`` (turns on a
        board with a think tag) and ``lookahead_exact``: how often it ends by naming all four
        cells right.
        """
        safe = unsafe = other = thought = exact = 0
        for observation, reply in turns:
            board = parse_board(observation or "")
            if board is None:
                continue
            where = [(r, c) for r, row in enumerate(board) for c, ch in enumerate(row) if ch == "P"]
            if len(where) != 1:
                continue
            r, c = where[0]
            think = extract_tag(reply, "think") if isinstance(reply, str) else None
            if think is not None:
                thought += 1
                exact += states_lookahead(think, _lookahead(board, (r, c)).strip())
            if r + 1 >= len(board) or c + 1 >= len(board[0]):
                continue
            down_hole, right_hole = board[r + 1][c] == "H", board[r][c + 1] == "H"
            if down_hole == right_hole:
                continue
            content = extract_tag(reply) if isinstance(reply, str) else None
            move = _ACTION_BY_WORD.get(content.lower()) if content is not None else None
            if move not in (DOWN, RIGHT):
                other += 1
            elif (move == DOWN) != down_hole:
                safe += 1
            else:
                unsafe += 1
        n = safe + unsafe
        out = {
            "probe_states": float(n + other),
            "probe_down_right": float(n),
            "probe_safe_rate": safe / n if n else float("nan"),
        }
        if thought:
            out.update(lookahead_turns=float(thought), lookahead_exact=exact / thought)
        return out

    # -- pictures -----------------------------------------------------------------------
    def render_image(self) -> np.ndarray:
        """The board as uint8 (nrow*28, ncol*28, 3): one 28x28 tile per cell."""
        tiles = _tiles()
        image = np.empty((self.nrow * TILE, self.ncol * TILE, 3), dtype=np.uint8)
        for r, row in enumerate(self.desc):
            for c, ch in enumerate(row):
                key = ch + ("P" if (r, c) == self.pos else "")
                image[r * TILE : (r + 1) * TILE, c * TILE : (c + 1) * TILE] = tiles[key]
        return image


class FrozenLakeVisionEnv(FrozenLakeEnv):
    """FrozenLake observed as an image; the text observation holds ``<image>`` for the board."""

    modality = "vision"
    #: Every observation is a picture to encode as PNG: the server's pool answers.
    quick_calls: ClassVar = frozenset()

    def instructions(self) -> str:
        return (
            "FrozenLake: move the player (red disc) to the goal (yellow diamond) on the image; "
            "light blue is frozen ice, stepping on a hole (dark circle) loses. "
            "Reply with one move: <answer>Left|Down|Right|Up</answer>."
        )

    def state_text(self) -> str:
        return IMAGE_PLACEHOLDER


def _lookahead(board: Sequence[Sequence[str]], pos: tuple[int, int]) -> str:
    """:meth:`FrozenLakeEnv.lookahead_text` of a board (rows of cell letters) with P at ``pos``."""
    cells = []
    for a in range(4):
        dr, dc = _MOVES[a]
        r, c = pos[0] + dr, pos[1] + dc
        inside = 0 <= r < len(board) and 0 <= c < len(board[0])
        cells.append(f" {ACTIONS[a]} {board[r][c] if inside else '-'}")
    return "".join(cells)


def _check_desc(desc: Any, shape: tuple[int, int] | None = None) -> list[str]:
    """Validate a fixed map and return it as a list of strings."""
    rows = [row.decode() if isinstance(row, bytes) else "".join(row) for row in desc]
    if not rows or any(len(row) != len(rows[0]) for row in rows) or len(rows[0]) < 1:
        raise ValueError(f"desc must be non-empty rows of equal length, got {desc!r}")
    bad = {ch for row in rows for ch in row} - set("SFHG")
    if bad:
        raise ValueError(f"desc may only contain S, F, H, G; found {sorted(bad)}")
    if shape is not None and (len(rows), len(rows[0])) != shape:
        raise ValueError(f"options['desc'] must be {shape[0]}x{shape[1]} like the env's map, got {len(rows)}x{len(rows[0])}")
    return rows


_COLOURS = {"F": (196, 228, 250), "S": (196, 228, 250), "H": (20, 40, 90), "G": (70, 180, 80)}


@lru_cache(maxsize=1)
def _tiles() -> dict[str, np.ndarray]:
    """Pre-drawn 28x28 tiles for every cell kind, with and without the player on it."""
    tiles: dict[str, np.ndarray] = {}
    for kind, colour in _COLOURS.items():
        for with_player in (False, True):
            img = Image.new("RGB", (TILE, TILE), colour)
            draw = ImageDraw.Draw(img)
            draw.rectangle([0, 0, TILE - 1, TILE - 1], outline=(120, 150, 180))
            if kind == "H":  # a dark hole with a black centre
                draw.ellipse([5, 5, TILE - 6, TILE - 6], fill=(0, 0, 0))
            elif kind == "G":  # a yellow star-ish diamond
                draw.polygon([(14, 3), (24, 14), (14, 25), (4, 14)], fill=(250, 210, 40))
            elif kind == "S":  # a small grey mark at the start
                draw.rectangle([3, 3, 8, 8], fill=(150, 170, 190))
            if with_player:  # a red disc as wide as the tile
                # A small disc in the middle of the tile (the earlier drawing) changes a tile's
                # vision-tower features far less than a hole does; the tiny VLM then learned to
                # transcribe holes and never the player (docs/results/vision.md#the-player).
                draw.ellipse([0, 0, TILE - 1, TILE - 1], fill=(220, 40, 40))
            tiles[kind + ("P" if with_player else "")] = np.asarray(img, dtype=np.uint8)
    return tiles
