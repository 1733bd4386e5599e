"""Sokoban levels and the XSB notation used by standard level collections.

XSB: ``#`` wall, `` `` floor (also ``-`` or ``_``), ``.`` goal, ``$`` box, ``*`` box on goal,
``@`` player, ``+`` player on goal. A collection holds levels separated by blank lines; lines
that start with ``;`` (comments) or that contain no board characters (titles, ``Title: ...``)
are skipped.

Levels are named the way the file names them: a comment ``; N`` before a level (the Boxoban
files number theirs ``; 0``, ``; 1``, ...) is its label; a level without one is labelled by its
position, counting from 1. Error messages use these labels. :class:`LevelCollection` indexes a
file in one pass and parses each level when it is first used, so a 100 MB collection opens in
seconds.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

_BOARD_CHARS = set("#@+$*. -_")
_FLOOR_CHARS = set(" -_")
#: A run of board lines: board characters only (trailing whitespace allowed), a wall in each.
_BOARD_BLOCK = re.compile(r"(?m)(?:^[#@+$*.\-_ ]*#[#@+$*.\-_ ]*[ \t\r\f\v]*(?:\n|\Z))+")
#: A "; N" header line.
_HEADER_LINE = re.compile(r"(?m)^;[ \t]*(\d+)[ \t\r]*$")
#: Files larger than this are refused (``LevelCollection(max_bytes=...)`` raises it).
MAX_FILE_BYTES = 512 << 20


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

    def box_mask(self) -> np.ndarray:
        """The starting boxes as a bool mask (H*W,), a new array each call."""
        mask = np.zeros(self.height * self.width, dtype=bool)
        mask[list(self.boxes)] = True
        return mask

    def to_xsb(self, boxes: np.ndarray | None = None, player: int | None = None, floor: str = " ") -> str:
        """The board (or the given box mask / player position on it) in XSB."""
        box_mask = self.box_mask() if boxes is None else np.asarray(boxes, dtype=bool)
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
    reach = reachable_cells(walls, height, width, player)
    if reach is None:
        raise LevelError("the player's area is not closed by walls (it reaches the edge of the level)")
    outside = ~walls & ~reach & np.isin(grid, list(_FLOOR_CHARS))
    return SokobanLevel(height, width, walls, goals, tuple(int(b) for b in box_cells), player, outside)


def reachable_cells(walls: np.ndarray, height: int, width: int, start: int) -> np.ndarray | None:
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


def _read_text(path: Path, max_bytes: int) -> str:
    """The file's text, or a :class:`LevelError` saying why it is not an XSB text file."""
    if not path.is_file():
        raise LevelError(f"levels file {path} does not exist" if not path.exists() else f"{path} is not a file")
    size = path.stat().st_size
    if size > max_bytes:
        raise LevelError(f"{path} is {size / 2**20:.0f} MB, more than the limit of {max_bytes / 2**20:.0f} MB "
                         "(max_bytes); split the collection")
    data = path.read_bytes()
    nul = data.find(b"\x00")
    if nul >= 0:
        raise LevelError(f"{path} is not a text file (a NUL byte at offset {nul}); XSB levels are plain text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise LevelError(f"{path} is not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r}); "
                         "XSB levels are plain text") from None


class LevelCollection:
    """The levels of an XSB file, indexed in one pass and parsed when first used.

    ``len(c)`` levels; ``c[i]`` parses level ``i`` (0-based position in the file; an LRU cache
    keeps recent ones) or raises :class:`LevelError` naming the level by its label;
    ``c.labels[i]`` is that label (the number of its ``; N`` header, else its 1-based position);
    ``c.max_height``, ``c.max_width`` bound every level (from the index, no parsing).
    """

    def __init__(self, path: str | Path, *, max_bytes: int = MAX_FILE_BYTES, cache_size: int = 4096) -> None:
        self.path = Path(path)
        self._text = _read_text(self.path, max_bytes)
        # One regex pass finds the boards (runs of lines of board characters holding a wall)
        # and another the "; N" headers; each level's label is the last header between the
        # previous board and it. A Python loop over lines took ~20 s per 100 MB; this ~3 s.
        starts: list[int] = []
        ends: list[int] = []
        heights: list[int] = []
        widths: list[int] = []
        for match in _BOARD_BLOCK.finditer(self._text):
            rows = match.group(0).rstrip().split("\n")
            starts.append(match.start())
            ends.append(match.start() + len(match.group(0).rstrip()))
            heights.append(len(rows))
            widths.append(max(len(r.rstrip()) for r in rows))
        if not starts:
            raise LevelError(f"{self.path}: no XSB level found (boards are rows of # @ + $ * . and spaces)")
        header_pos, header_num = [], []
        for match in _HEADER_LINE.finditer(self._text):
            header_pos.append(match.start())
            header_num.append(match.group(1))
        labels = [str(i + 1) for i in range(len(starts))]
        if header_pos:
            hp = np.asarray(header_pos, dtype=np.int64)
            st = np.asarray(starts, dtype=np.int64)
            last = np.searchsorted(hp, st) - 1  # the last header before each board
            prev_end = np.concatenate([[-1], np.asarray(ends[:-1], dtype=np.int64)])
            for i in np.flatnonzero((last >= 0) & (hp[np.maximum(last, 0)] > prev_end)).tolist():
                labels[i] = header_num[int(last[i])]
        self._starts = np.asarray(starts, dtype=np.int64)
        self._ends = np.asarray(ends, dtype=np.int64)
        self.labels: list[str] = labels
        self.max_height, self.max_width = max(heights), max(widths)
        self._cache: OrderedDict[int, SokobanLevel] = OrderedDict()
        self._cache_size = int(cache_size)
        self._lock = threading.Lock()  # shared by the envs of a process (shared_collection)

    def __len__(self) -> int:
        return len(self._starts)

    def text(self, index: int) -> str:
        """The XSB text of level ``index``."""
        return self._text[int(self._starts[index]) : int(self._ends[index])]

    def __getitem__(self, index: int) -> SokobanLevel:
        if not 0 <= index < len(self):
            raise IndexError(f"level index {index} out of range: {self.path} has {len(self)} levels")
        with self._lock:
            level = self._cache.get(index)
            if level is not None:
                self._cache.move_to_end(index)
                return level
        try:
            level = parse_xsb(self.text(index))
        except LevelError as exc:
            raise LevelError(f"{self.path}: level {self.labels[index]}: {exc}") from None
        with self._lock:
            self._cache[index] = level
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return level

    def validate(self) -> None:
        """Parse every level now (raises the first :class:`LevelError`)."""
        for i in range(len(self)):
            self[i]


def load_xsb(path: str | Path) -> list[SokobanLevel]:
    """Load every level of an XSB file (a single level or a collection), validating each."""
    collection = LevelCollection(path)
    return [collection[i] for i in range(len(collection))]
