"""Sokoban levels and the XSB notation used by standard level collections.

XSB: ``#`` wall, `` `` floor (also ``-`` or ``_``), ``.`` goal, ``$`` box, ``*`` box on goal,
``@`` player, ``+`` player on goal. A collection holds levels separated by blank lines; lines
that start with ``;`` (comments) or that contain no board characters (titles, ``Title: ...``)
are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

_BOARD_CHARS = set("#@+$*. -_")
_FLOOR_CHARS = set(" -_")


class LevelError(ValueError):
    """An XSB level is malformed (not one player, boxes != goals, not closed by walls, ...)."""


@dataclass(frozen=True)
class SokobanLevel:
    """A Sokoban board: fixed layout plus the starting positions.

    Cells are numbered row-major (``index = row * width + col``) so the dynamics work on flat
    arrays. ``outside`` marks floor the player can never reach (the blank margin of irregular
    XSB levels); it is drawn as background.
    """

    height: int
    width: int
    walls: np.ndarray  # bool (H*W,)
    goals: np.ndarray  # bool (H*W,)
    boxes: tuple[int, ...]  # sorted flat indices
    player: int
    outside: np.ndarray  # bool (H*W,)

    @property
    def num_boxes(self) -> int:
        return len(self.boxes)

    def to_xsb(self, boxes: np.ndarray | None = None, player: int | None = None, floor: str = " ") -> str:
        """The board (or the given box mask / player position on it) in XSB."""
        box_mask = np.zeros(self.height * self.width, dtype=bool)
        if boxes is None:
            box_mask[list(self.boxes)] = True
        else:
            box_mask = np.asarray(boxes, dtype=bool)
        player = self.player if player is None else player
        chars = np.full(self.height * self.width, floor, dtype="<U1")
        chars[self.outside] = " "
        chars[self.goals] = "."
        chars[box_mask] = "$"
        chars[box_mask & self.goals] = "*"
        chars[self.walls] = "#"
        if player >= 0:  # a negative player draws the board without one
            chars[player] = "+" if self.goals[player] else "@"
        rows = ["".join(r).rstrip() for r in chars.reshape(self.height, self.width)]
        return "\n".join(rows)


def parse_xsb(text: str) -> SokobanLevel:
    """Parse one level written in XSB; raise :class:`LevelError` saying what is wrong."""
    rows = [r.rstrip("\r") for r in text.strip("\n").split("\n")]
    rows = [r for r in rows if r.strip() and not r.lstrip().startswith(";")]
    if not rows:
        raise LevelError("empty level: expected rows of XSB characters (# @ + $ * . and space)")
    for i, row in enumerate(rows):
        bad = set(row) - _BOARD_CHARS
        if bad:
            raise LevelError(f"row {i} of the level has characters outside XSB: {sorted(bad)!r}")
    height, width = len(rows), max(len(r) for r in rows)
    grid = np.array([list(r.ljust(width)) for r in rows], dtype="<U1").reshape(-1)
    walls = grid == "#"
    goals = np.isin(grid, [".", "*", "+"])
    box_cells = np.flatnonzero(np.isin(grid, ["$", "*"]))
    players = np.flatnonzero(np.isin(grid, ["@", "+"]))
    if len(players) != 1:
        raise LevelError(f"a level needs exactly one player (@ or +), found {len(players)}")
    if len(box_cells) == 0:
        raise LevelError("a level needs at least one box ($ or *)")
    if len(box_cells) != int(goals.sum()):
        raise LevelError(
            f"a level needs as many goals as boxes: {len(box_cells)} boxes ($, *) but "
            f"{int(goals.sum())} goals (., *, +)"
        )
    player = int(players[0])
    reach = _reachable(walls, height, width, player)
    if reach is None:
        raise LevelError("the player's area is not closed by walls (it reaches the edge of the level)")
    outside = ~walls & ~reach & np.isin(grid, list(_FLOOR_CHARS))
    return SokobanLevel(height, width, walls, goals, tuple(int(b) for b in box_cells), player, outside)


def _reachable(walls: np.ndarray, height: int, width: int, start: int) -> np.ndarray | None:
    """Cells connected to ``start`` through non-wall cells, or None if that area is open."""
    seen = np.zeros(height * width, dtype=bool)
    seen[start] = True
    stack = [start]
    while stack:
        cell = stack.pop()
        r, c = divmod(cell, width)
        if r in (0, height - 1) or c in (0, width - 1):
            return None
        for nxt in (cell - width, cell + width, cell - 1, cell + 1):
            if not walls[nxt] and not seen[nxt]:
                seen[nxt] = True
                stack.append(nxt)
    return seen


def split_xsb_collection(text: str) -> list[str]:
    """Split a collection into level strings (blank lines separate levels; comments dropped)."""
    levels: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        is_board = bool(stripped) and not stripped.startswith(";") and set(line.rstrip()) <= _BOARD_CHARS
        if is_board and "#" in line:
            current.append(line.rstrip())
        elif current:
            levels.append("\n".join(current))
            current = []
    if current:
        levels.append("\n".join(current))
    return levels


def load_xsb(path: str | Path) -> list[SokobanLevel]:
    """Load every level of an XSB file (a single level or a collection)."""
    text = Path(path).read_text(encoding="utf-8")
    chunks = split_xsb_collection(text)
    if not chunks:
        raise LevelError(f"{path}: no XSB level found")
    levels = []
    for i, chunk in enumerate(chunks):
        try:
            levels.append(parse_xsb(chunk))
        except LevelError as exc:
            raise LevelError(f"{path}: level {i + 1}: {exc}") from None
    return levels
