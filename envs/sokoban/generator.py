"""Procedural Sokoban rooms that are solvable within a move budget by construction.

As in the classic gym-sokoban generator, a room is carved by a random walk and the level is
found by playing backwards from a solved state (the player *pulls* boxes off the goals). The
difference is the search: instead of a depth-first walk over pulls, a level-synchronous
breadth-first search over exact moves (walks and pulls) runs on whole frontiers at once in
numpy, with states coded as int64 keys. Starting from every solved state (boxes on goals,
player anywhere), the depth at which a state is first reached is exactly its optimal forward
solution length in moves, so choosing a state with depth <= ``max_moves`` guarantees the level
is solvable in that many moves, and its optimal length is known.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from envs.sokoban.xsb import SokobanLevel

logger = logging.getLogger(__name__)

# 3x3 brushes of the classic random-walk room carver.
_MASKS = np.array(
    [
        [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
        [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [0, 1, 0]],
        [[0, 0, 0], [1, 1, 0], [1, 1, 0]],
        [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
    ],
    dtype=bool,
)
_DIRECTIONS = np.array([(-1, 0), (1, 0), (0, -1), (0, 1)])


class GenerationError(RuntimeError):
    """No level with the requested size, boxes and move budget could be generated."""


@dataclass(frozen=True)
class GeneratedRoom:
    """A generated level and the exact length of its optimal solution, in moves."""

    level: SokobanLevel
    optimal_moves: int


def carve_topology(rng: np.random.Generator, height: int, width: int, num_steps: int | None = None) -> np.ndarray:
    """Floor mask (bool H x W) carved by a random walk of 3x3 brushes, walls on the border."""
    if num_steps is None:
        num_steps = int(1.5 * (height + width))
    floor = np.zeros((height + 2, width + 2), dtype=bool)  # +1 margin so brushes never clip
    pos = np.array([rng.integers(1, height - 1), rng.integers(1, width - 1)])
    direction = _DIRECTIONS[rng.integers(4)]
    for _ in range(num_steps):
        if rng.random() < 0.35:
            direction = _DIRECTIONS[rng.integers(4)]
        pos = np.clip(pos + direction, 1, [height - 2, width - 2])
        floor[pos[0] : pos[0] + 3, pos[1] : pos[1] + 3] |= _MASKS[rng.integers(len(_MASKS))]
    floor = floor[1:-1, 1:-1].copy()
    floor[[0, -1], :] = False
    floor[:, [0, -1]] = False
    return floor


def reverse_search(
    floor: np.ndarray, width: int, goals: np.ndarray, max_moves: int, budget: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All states within ``max_moves`` reverse moves of the solved states (up to ``budget``).

    Args:
        floor: bool (H*W,) walkable cells (border cells must be walls).
        width: row length of the board.
        goals: sorted flat indices of the goals (boxes start there).
        max_moves: depth limit of the search.
        budget: stop expanding once this many states are known.

    Returns:
        ``(players (N,), boxes (N, k) sorted rows, depth (N,))``; every depth is exact.
    """
    ncells = floor.size
    deltas = np.array([-width, width, -1, 1])
    k = len(goals)
    radix = np.int64(ncells) ** np.arange(1, k + 1, dtype=np.int64)
    if ncells ** (k + 1) >= 2**62:
        raise GenerationError(f"room of {ncells} cells with {k} boxes is too large to encode")

    def encode(p: np.ndarray, b: np.ndarray) -> np.ndarray:
        return p.astype(np.int64) + b.astype(np.int64) @ radix

    starts = np.flatnonzero(floor)
    starts = starts[~np.isin(starts, goals)]
    players = [starts]
    boxes = [np.repeat(goals[None, :], len(starts), axis=0)]
    depths = [np.zeros(len(starts), dtype=np.int32)]
    visited = np.sort(encode(players[0], boxes[0]))
    frontier_p, frontier_b = players[0], boxes[0]
    total = len(starts)
    for depth in range(1, max_moves + 1):
        if len(frontier_p) == 0 or total >= budget:
            break
        cand_p, cand_b = [], []
        for delta in deltas:
            back = frontier_p - delta
            free = floor[back] & ~(frontier_b == back[:, None]).any(axis=1)
            cand_p.append(back[free])
            cand_b.append(frontier_b[free])
            hit = frontier_b == (frontier_p + delta)[:, None]
            pull = free & hit.any(axis=1)
            if pull.any():
                moved = frontier_b[pull].copy()
                moved[hit[pull]] = frontier_p[pull]
                moved.sort(axis=1)
                cand_p.append(back[pull])
                cand_b.append(moved)
        new_p = np.concatenate(cand_p)
        new_b = np.concatenate(cand_b)
        keys, first = np.unique(encode(new_p, new_b), return_index=True)
        pos = np.searchsorted(visited, keys)
        seen = visited[np.minimum(pos, len(visited) - 1)] == keys
        keep = first[~seen]
        if len(keep) == 0:
            break
        frontier_p, frontier_b = new_p[keep], new_b[keep]
        visited = np.sort(np.concatenate([visited, keys[~seen]]))
        players.append(frontier_p)
        boxes.append(frontier_b)
        depths.append(np.full(len(keep), depth, dtype=np.int32))
        total += len(keep)
    return np.concatenate(players), np.concatenate(boxes), np.concatenate(depths)


def generate_room(
    rng: np.random.Generator,
    height: int = 6,
    width: int = 6,
    num_boxes: int = 1,
    max_moves: int = 10,
    *,
    min_moves: int | None = None,
    budget: int = 30_000,
    tries: int = 50,
) -> GeneratedRoom:
    """Generate a level solvable in at most ``max_moves`` moves (walls included in the size).

    The chosen start state maximises, in order of weight: boxes off their goals, the boxes'
    distance to the nearest goal, and the optimal solution length, with a random tie-break
    so that equal-scoring rooms vary. Rooms whose best level needs fewer than ``min_moves``
    moves (default ``max_moves // 3``) are discarded, so trivial levels are rare.
    """
    if min_moves is None:
        min_moves = max(1, max_moves // 3)
    if height < 4 or width < 4:
        raise ValueError(f"a room needs at least 4x4 cells including walls, got {height}x{width}")
    if num_boxes < 1:
        raise ValueError(f"num_boxes must be >= 1, got {num_boxes}")
    if not 1 <= min_moves <= max_moves:
        raise ValueError(f"need 1 <= min_moves <= max_moves, got min_moves={min_moves}, max_moves={max_moves}")
    if num_boxes + 1 > (height - 2) * (width - 2) - 1:
        raise ValueError(f"{num_boxes} boxes do not fit a {height}x{width} room")
    for attempt in range(tries):
        floor2d = carve_topology(rng, height, width)
        cells = np.flatnonzero(floor2d)
        if len(cells) < num_boxes + 2:
            continue
        goals = np.sort(rng.choice(cells, size=num_boxes, replace=False))
        room = _search_room(rng, floor2d, goals, min_moves, max_moves, budget)
        if room is not None:
            return room
        logger.debug("attempt %d: no pullable start state, new topology", attempt)
    raise GenerationError(
        f"no {height}x{width} room with {num_boxes} boxes solvable in {max_moves} moves after "
        f"{tries} tries (min_moves={min_moves}); raise max_moves or lower num_boxes/min_moves"
    )


def _search_room(
    rng: np.random.Generator, floor2d: np.ndarray, goals: np.ndarray, min_moves: int, max_moves: int, budget: int
) -> GeneratedRoom | None:
    """The best-scoring level of one room and goal layout, or None if none qualifies."""
    height, width = floor2d.shape
    players, boxes, depth = reverse_search(floor2d.reshape(-1), width, goals, max_moves, budget)
    on_goal = np.isin(boxes, goals)
    off = (~on_goal).sum(axis=1)
    candidates = np.flatnonzero((off > 0) & (depth >= min_moves))
    if len(candidates) == 0:
        return None
    b = boxes[candidates]
    br, bc = np.divmod(b, width)
    gr, gc = np.divmod(goals, width)
    dist = np.abs(br[:, :, None] - gr[None, None, :]) + np.abs(bc[:, :, None] - gc[None, None, :])
    displacement = dist.min(axis=2).sum(axis=1)
    score = 10.0 * off[candidates] + displacement + 0.25 * depth[candidates] + rng.random(len(candidates))
    best = candidates[int(np.argmax(score))]
    walls = ~floor2d.reshape(-1)
    goal_mask = np.zeros(height * width, dtype=bool)
    goal_mask[goals] = True
    level = SokobanLevel(
        height,
        width,
        walls,
        goal_mask,
        tuple(int(x) for x in boxes[best]),
        int(players[best]),
        np.zeros(height * width, dtype=bool),
    )
    return GeneratedRoom(level, int(depth[best]))
