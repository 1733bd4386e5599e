"""Pillow rendering of Sokoban boards as uint8 RGB arrays (no pygame).

Each cell is one square tile (28 px by default: one Qwen2-VL visual token per cell). Tiles are
drawn once per size and cached; a frame is a numpy gather of tiles, so rendering is cheap.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

# Cell codes, in the order of the tile stack.
OUTSIDE, WALL, FLOOR, GOAL, BOX, BOX_ON_GOAL, PLAYER, PLAYER_ON_GOAL = range(8)

_BACKGROUND = (20, 20, 20)
_WALL = (110, 60, 40)
_MORTAR = (70, 38, 25)
_FLOOR = (225, 215, 190)
_GOAL = (220, 40, 40)
_BOX = (230, 160, 40)
_BOX_EDGE = (130, 80, 10)
_BOX_DONE = (60, 170, 60)
_PLAYER = (40, 80, 220)


@lru_cache(maxsize=8)
def tiles(size: int) -> np.ndarray:
    """The 8 cell tiles as uint8 (8, size, size, 3), indexed by the cell codes above."""
    if size < 4:
        raise ValueError(f"tile size must be >= 4 px, got {size}")
    out = []
    s = size - 1
    m = max(1, size // 7)  # margin of the drawn objects
    for code in range(8):
        img = Image.new("RGB", (size, size), _FLOOR)
        d = ImageDraw.Draw(img)
        if code == OUTSIDE:
            d.rectangle([0, 0, s, s], fill=_BACKGROUND)
        elif code == WALL:
            d.rectangle([0, 0, s, s], fill=_WALL)
            d.line([0, size // 2, s, size // 2], fill=_MORTAR, width=max(1, size // 14))
            d.line([size // 2, 0, size // 2, size // 2], fill=_MORTAR, width=max(1, size // 14))
        if code in (GOAL, BOX_ON_GOAL, PLAYER_ON_GOAL):
            r = max(2, size // 5)
            c = size // 2
            d.ellipse([c - r, c - r, c + r, c + r], outline=_GOAL, width=max(1, size // 10))
        if code in (BOX, BOX_ON_GOAL):
            fill = _BOX_DONE if code == BOX_ON_GOAL else _BOX
            d.rectangle([m, m, s - m, s - m], fill=fill, outline=_BOX_EDGE, width=max(1, size // 14))
            d.line([m, m, s - m, s - m], fill=_BOX_EDGE, width=max(1, size // 14))
            d.line([m, s - m, s - m, m], fill=_BOX_EDGE, width=max(1, size // 14))
        if code in (PLAYER, PLAYER_ON_GOAL):
            d.ellipse([m + 1, m, s - m - 1, s - m], fill=_PLAYER)
        out.append(np.asarray(img, dtype=np.uint8))
    return np.stack(out)


def render_cells(codes: np.ndarray, tile_size: int, shape: tuple[int, int] | None = None) -> np.ndarray:
    """Draw a (rows, cols) grid of cell codes; pad with background to ``shape`` (rows, cols)."""
    rows, cols = codes.shape
    if shape is not None and (shape[0] > rows or shape[1] > cols):
        padded = np.full(shape, OUTSIDE, dtype=codes.dtype)
        padded[:rows, :cols] = codes
        codes, (rows, cols) = padded, shape
    frame = tiles(tile_size)[codes]  # (rows, cols, t, t, 3)
    return np.ascontiguousarray(frame.transpose(0, 2, 1, 3, 4).reshape(rows * tile_size, cols * tile_size, 3))
