"""Sokoban: solvability of generated levels (independent solver), rewards, XSB, parsing, seeding."""

from __future__ import annotations

import heapq
import itertools
import warnings
from collections import deque

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from envs.sokoban.env import ACTIONS as _SOKO_ACTIONS

import envs  # noqa: F401  (registers the tasks)
from envs.base import IMAGE_PLACEHOLDER
from envs.sokoban import PRESETS, LevelError, SokobanEnv, SokobanVisionEnv, load_xsb, parse_xsb

# -- an independent solver: A* over push states with exact move costs ---------------------------


def _live_cells(walls: frozenset, goals: frozenset, width: int) -> frozenset:
    """Cells from which a lone box can still reach some goal (pull closure from the goals)."""
    live, todo = set(goals), deque(goals)
    while todo:
        cell = todo.popleft()
        for d in (-width, width, -1, 1):
            src, stand = cell - d, cell - 2 * d  # a box at src pushed by a player at stand
            if src not in walls and stand not in walls and src not in live:
                live.add(src)
                todo.append(src)
    return frozenset(live)


def solve_moves(xsb: str, limit: int) -> int | None:
    """Fewest moves that solve ``xsb`` if at most ``limit``, else None.

    A* over the states right after each push: the cost of a push is the player's walk to the
    cell behind the box (a BFS) plus one. The heuristic (Manhattan distances of the cheapest
    box-to-goal assignment) never overestimates, since every push moves one box one cell.
    Ties go to the deepest state, which reaches the goal sooner.
    """
    rows = xsb.split("\n")
    width = max(len(r) for r in rows)
    cells = "".join(r.ljust(width) for r in rows)
    walls = frozenset(i for i, ch in enumerate(cells) if ch == "#")
    goals = frozenset(i for i, ch in enumerate(cells) if ch in ".*+")
    boxes = frozenset(i for i, ch in enumerate(cells) if ch in "$*")
    player = next(i for i, ch in enumerate(cells) if ch in "@+")
    live = _live_cells(walls, goals, width)  # never contains a wall
    neighbours = [
        [n for n in (i - width, i + width, i - 1, i + 1) if 0 <= n < len(cells) and n not in walls]
        for i in range(len(cells))
    ]
    goal_rc = [divmod(g, width) for g in goals]

    orders = list(itertools.permutations(range(len(goal_rc))))

    def h(bx: frozenset) -> int:
        """Cheapest assignment of boxes to distinct goals, by Manhattan distance."""
        rc = [divmod(b, width) for b in bx]
        cost = [[abs(r - gr) + abs(c - gc) for gr, gc in goal_rc] for r, c in rc]
        return min(sum(cost[i][j] for i, j in enumerate(order)) for order in orders)

    if boxes == goals:
        return 0
    best = {(player, boxes): 0}
    heap = [(h(boxes), 0, player, boxes)]
    while heap:
        f, neg_g, p, bx = heapq.heappop(heap)
        g = -neg_g
        if best.get((p, bx), 1 << 30) < g:
            continue
        if bx == goals:
            return g
        dist = [-1] * len(cells)
        dist[p] = 0
        for b in bx:
            dist[b] = -2  # boxes block the walk
        todo = deque([p])
        while todo:
            cell = todo.popleft()
            for nxt in neighbours[cell]:
                if dist[nxt] == -1:
                    dist[nxt] = dist[cell] + 1
                    todo.append(nxt)
        for b in bx:
            for d in (-width, width, -1, 1):
                stand, target = b - d, b + d
                if dist[stand] < 0 or target in bx or target not in live:
                    continue
                nb = (bx - {b}) | {target}
                ng = g + dist[stand] + 1
                nf = ng + h(nb)
                if nf <= limit and ng < best.get((b, nb), 1 << 30):
                    best[(b, nb)] = ng
                    heapq.heappush(heap, (nf, -ng, b, nb))
    return None


def test_solver_on_known_levels():
    assert solve_moves("#####\n#@$.#\n#####", 5) == 1
    assert solve_moves("######\n#@ $.#\n######", 5) == 2
    assert solve_moves("######\n#@ $.#\n######", 1) is None
    assert solve_moves("####\n#@$#\n# .#\n####", 20) is None  # box in a corner


@pytest.mark.parametrize("preset", [pytest.param(p, marks=pytest.mark.slow) if p == "large" else p for p in sorted(PRESETS)])
def test_generated_levels_are_solvable_within_turn_limit(preset):
    """For 500 seeds an independent solver finds the generator's claimed optimum, within the limit."""
    env = SokobanEnv(preset=preset, render_mode="ansi")
    for seed in range(500):
        _, info = env.reset(seed=seed)
        xsb = env.render()
        moves = solve_moves(xsb, env.max_turns)
        assert moves is not None, f"seed {seed}: unsolvable in {env.max_turns} moves:\n{xsb}"
        assert moves == info["optimal_moves"], f"seed {seed}: solver {moves} != generator {info['optimal_moves']}"
        assert 1 <= moves <= env.max_solution_moves <= env.max_turns
        assert info["num_boxes"] == PRESETS[preset].num_boxes
        assert xsb.count("$") + xsb.count("*") == PRESETS[preset].num_boxes
        assert len(xsb.split("\n")) == PRESETS[preset].size[0]


def test_custom_size_and_boxes():
    env = SokobanEnv(size=(7, 9), num_boxes=2)
    _, info = env.reset(seed=1)
    rows = env.render_text().split("\n")
    assert len(rows) == 7 and info["num_boxes"] == 2
    assert solve_moves(env.render_text(), env.max_turns) == info["optimal_moves"]


# -- gymnasium contract -------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", ["freshper/Sokoban-v0", "freshper/SokobanVision-v0"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_check_env_passes(env_id, preset):
    for mode in ("ansi", "rgb_array"):
        env = gymnasium.make(env_id, preset=preset, render_mode=mode)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checker warning is a failure
            check_env(env.unwrapped, skip_render_check=False)


def test_seeded_reset_is_deterministic_and_seeds_differ():
    a, b = SokobanEnv(preset="hard"), SokobanEnv(preset="hard")
    boards = set()
    for seed in range(5):
        oa, ia = a.reset(seed=seed)
        ob, ib = b.reset(seed=seed)
        assert oa == ob and ia == ib
        boards.add(a.render_text())
    assert len(boards) == 5


def test_text_and_vision_share_levels_and_dynamics():
    text, vision = SokobanEnv(), SokobanVisionEnv()
    text.reset(seed=7)
    obs, _ = vision.reset(seed=7)
    assert text.render_text() == vision.render_text()
    assert IMAGE_PLACEHOLDER in obs["text"] and "#" not in obs["text"].split("Board:")[-1]
    assert obs["image"].dtype == np.uint8 and obs["image"].shape == (6 * 28, 6 * 28, 3)
    for move in ["Left", "Down", "Right", "Up", "Down"]:
        r1 = text.step(SokobanEnv.format_reply(move))
        r2 = vision.step(SokobanEnv.format_reply(move))
        assert r1[1:] == r2[1:]
        assert text.render_text() == vision.render_text()
        if r1[2] or r1[3]:
            break


def test_image_shows_the_state():
    env = SokobanVisionEnv(level="#####\n#@$.#\n#####", tile_size=16, render_mode="rgb_array")
    obs, _ = env.reset(seed=0)
    assert obs["image"].shape == (48, 80, 3)
    before = obs["image"].copy()
    obs, *_ = env.step("<answer>Right</answer>")
    assert not np.array_equal(before, obs["image"])
    assert np.array_equal(env.render(), obs["image"])


# -- rewards on hand-made levels ----------------------------------------------------------------


def _play(env: SokobanEnv, moves: list[str]) -> list[tuple[float, bool, bool]]:
    out = []
    for m in moves:
        _, r, term, trunc, info = env.step(f"<answer>{m}</answer>")
        out.append((round(r, 6), term, info["success"]))
    return out


def test_reward_table():
    env = SokobanEnv(level="#######\n#@ $. #\n#  $. #\n#######")
    env.reset(seed=0)
    # walk, push onto goal (+1), push it off again (-1), wall bump (no change)
    steps = _play(env, ["Right", "Right", "Right", "Up"])
    assert steps == [(-0.1, False, False), (0.9, False, False), (-1.1, False, False), (-0.1, False, False)]
    assert env.render_text() == "#######\n#   +$#\n#  $. #\n#######"


def test_reward_solving_and_blocked_push():
    env = SokobanEnv(level="######\n#@$$.#\n#   .#\n######")
    env.reset(seed=0)
    board = env.render_text()
    assert _play(env, ["Right"]) == [(-0.1, False, False)]  # two boxes in a row do not move
    assert env.render_text() == board
    env = SokobanEnv(level="#####\n#@$.#\n#####")
    env.reset(seed=0)
    obs, r, term, trunc, info = env.step("<answer>Right</answer>")
    assert r == pytest.approx(-0.1 + 1 + 10) and term and not trunc and info["success"]
    assert env.render_text() == "#####\n# @*#\n#####"
    assert "solved" in obs["text"]


def test_truncation_at_turn_limit():
    env = SokobanEnv(level="#######\n#@  $.#\n#######", max_turns=2)
    env.reset(seed=0)
    _, _, term, trunc, info = env.step("<answer>Left</answer>")
    assert not trunc
    _, _, term, trunc, info = env.step("<answer>Left</answer>")
    assert trunc and not term and not info["success"]


def test_specific_sequences_of_moves():
    env = SokobanEnv(level="#######\n#@ $. #\n#  $. #\n#######")
    env.reset(seed=0)
    _play(env, ["Right", "Right"])
    assert env.render_text() == "#######\n#  @* #\n#  $. #\n#######"


# -- replies ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply", ["<answer> up </answer>", "<ANSWER>UP</ANSWER>", "think... <answer>Up.</answer>"])
def test_lenient_replies(reply):
    env = SokobanEnv(level="#####\n# . #\n# $ #\n# @ #\n#####")
    env.reset(seed=0)
    _, r, term, _, info = env.step(reply)
    assert info["action_is_valid"] and term and r == pytest.approx(10.9)


@pytest.mark.parametrize("reply", ["Up", "<answer>upward</answer>", "", "<answer></answer>", "x" * (1 << 20), "<answer>上</answer>"])
def test_invalid_replies_leave_state_unchanged(reply):
    env = SokobanEnv(level="#####\n# . #\n# $ #\n# @ #\n#####")
    env.reset(seed=0)
    board = env.render_text()
    obs, r, term, trunc, info = env.step(reply)
    assert not info["action_is_valid"] and r == env.format_penalty and not term
    assert env.render_text() == board
    assert "Invalid reply" in obs["text"]


def test_legal_actions_and_format_reply():
    env = SokobanEnv()
    assert env.legal_actions() == ["Up", "Down", "Left", "Right"]
    assert SokobanEnv.format_reply("left") == "<answer>Left</answer>"
    with pytest.raises(ValueError):
        SokobanEnv.format_reply("jump")


def test_effective_actions_are_the_moves_that_change_the_state():
    """Checked against the real step on states from random play: a move is effective exactly
    when stepping it changes the board; random replies only draw effective moves; the
    lookahead says move/push exactly for those, push where a box is next."""
    rng = np.random.default_rng(0)
    seen_blocked = 0
    for seed in range(30):
        env = SokobanEnv(preset="simple", feedback=False)
        env.reset(seed=seed)
        for _ in range(6):
            before = env.render_text()
            effective = env.effective_actions()
            for move in env.legal_actions():
                probe = SokobanEnv(preset="simple", feedback=False)
                probe.reset(seed=seed)
                probe._player, probe._boxes = env._player, env._boxes.copy()
                probe.step(SokobanEnv.format_reply(move))
                assert (probe.render_text() != before) == (move in effective), (seed, move, before)
            seen_blocked += 4 - len(effective)
            words = dict(zip(env.lookahead_text().split()[::2], env.lookahead_text().split()[1::2]))
            assert list(words) == list(env.legal_actions())
            assert {m for m, w in words.items() if w in ("move", "push")} == set(effective)
            assert all((w in ("push", "blocked")) == bool(env._boxes[env._player + env._delta(i)])
                       for i, w in enumerate(words.values()) if w != "wall")
            reply = env.sample_reply(rng)
            assert env.describe_action(reply) in effective
            _, _, terminated, truncated, _ = env.step(reply)
            if terminated or truncated:
                break
    assert seen_blocked > 0  # the states include blocked moves, so the check above bites


@pytest.mark.parametrize("board", ["xsb", "spaced", "letters"])
def test_turn_diagnostics_count_wasted_moves_and_exact_lookaheads_from_the_text(board):
    """The evaluation's Sokoban numbers read the board back from the observation text (with
    feedback, any notation) and agree with the live env: the no-op rate with the moves the
    real step did not carry out, the exact lookahead with the env's own lookahead."""
    from envs.capabilities import think_reply
    from envs.sokoban.env import ACTIONS

    rng = np.random.default_rng(1)
    turns, wasted, moves, true_looks, right_looks = [], 0, 0, 0, 0
    env = SokobanEnv(preset="simple", feedback=True, board=board)
    for seed in range(12):
        obs, _ = env.reset(seed=seed)
        done = False
        while not done:
            move = ACTIONS[int(rng.integers(4))]
            honest = rng.random() < 0.5
            look = env.lookahead_text() if honest else " Up move Down move Left move Right move"
            reply = think_reply(look, f"<answer>{move}</answer>") if seed % 3 else f"<answer>{move}</answer>"
            if seed % 3 == 0 and rng.random() < 0.2:
                reply = "<answer>jump</answer>"  # invalid: not a move, not counted
            before, truth = env.render_text(), env.lookahead_text()
            turns.append((obs["text"], reply))
            obs, _, terminated, truncated, _ = env.step(reply)
            if reply != "<answer>jump</answer>":
                moves += 1
                wasted += env.render_text() == before
            if seed % 3:
                true_looks += 1
                right_looks += look == truth
            done = terminated or truncated
    d = SokobanEnv.turn_diagnostics(turns)
    assert d["noop_moves"] == moves and d["noop_rate"] == pytest.approx(wasted / moves)
    assert 0 < wasted < moves
    assert d["lookahead_turns"] == true_looks and d["lookahead_exact"] == pytest.approx(right_looks / true_looks)
    assert 0 < right_looks < true_looks
    assert SokobanEnv.turn_diagnostics([("no board here", "<answer>Up</answer>")])["noop_moves"] == 0


@pytest.mark.parametrize("board", ["spaced", "letters"])
def test_board_notations_write_each_cell_after_a_space_in_observation_and_dynamics_target(board):
    plain = SokobanEnv(preset="simple", feedback=False)
    other = SokobanEnv(preset="simple", feedback=False, board=board)
    for env in (plain, other):
        env.reset(seed=3)
        env.step("<answer>Left</answer>")
    rows = plain.state_text().split("\n")[1:]
    letters = {"#": "w", "_": "f", ".": "o", "$": "b", "*": "d", "@": "p", "+": "P"}
    expect = ["".join(" " + (letters[ch] if board == "letters" else ch) for ch in row) for row in rows]
    assert other.state_text().split("\n")[1:] == expect
    assert other.outcome_text(False, False) == "\n".join(expect)  # the dynamics target in the same notation
    assert other.render_text() == plain.render_text()  # ansi stays standard XSB
    assert ("w wall" in other.instructions()) == (board == "letters")
    with pytest.raises(ValueError, match="notation"):
        SokobanEnv(board="ascii")


def test_letters_board_is_one_token_per_cell_for_the_embedded_tokenizer():
    from transformers import AutoTokenizer

    from agents.policies.tiny import build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model("text"))
    env = SokobanEnv(preset="simple", feedback=False, board="letters")
    env.reset(seed=4)
    board = env.outcome_text(False, False)
    pieces = [tok.decode([i]) for i in tok(board)["input_ids"]]
    assert [p for p in pieces if p != "\n"] == [" " + c for c in board.replace("\n", "").split(" ")[1:]]


# -- XSB ----------------------------------------------------------------------------------------

COLLECTION = """; two small levels
Title: first
  #####
###   #
#.@$  #
### $.#
#.##$ #
# # . ##
#$ *$$.#
#   .  #
########

; second
#####
#@$.#
#####
"""


def test_xsb_round_trip_and_collection(tmp_path):
    path = tmp_path / "levels.xsb"
    path.write_text(COLLECTION)
    levels = load_xsb(path)
    assert len(levels) == 2 and levels[0].num_boxes == 7
    for level in levels:
        assert parse_xsb(level.to_xsb()).to_xsb() == level.to_xsb()
    assert levels[0].to_xsb().split("\n")[0] == "  #####"
    env = SokobanEnv(levels_file=str(path), render_mode="ansi")
    seen = {env.reset(seed=s)[1]["level_index"] for s in range(20)}
    assert seen == {0, 1}
    env.reset(options={"level_index": 1})
    assert env.render() == "#####\n#@$.#\n#####"
    # a generated room round-trips too
    gen = SokobanEnv(preset="large")
    gen.reset(seed=3)
    assert parse_xsb(gen.render_text()).to_xsb() == gen.render_text()


def test_irregular_levels_pad_images(tmp_path):
    path = tmp_path / "levels.xsb"
    path.write_text(COLLECTION)
    env = SokobanVisionEnv(levels_file=str(path), tile_size=8)
    obs, _ = env.reset(options={"level_index": 1})
    assert obs["image"].shape == env.observation_space["image"].shape == (9 * 8, 8 * 8, 3)


@pytest.mark.parametrize(
    "xsb, message",
    [
        ("#####\n#$ .#\n#####", "exactly one player"),
        ("#####\n#@$@#\n#.  #\n#####", "exactly one player"),
        ("#####\n#@$ #\n#####", "as many goals as boxes"),
        ("#####\n#@ .#\n#####", "at least one box"),
        ("#####\n#@$. \n#####", "not closed"),
        ("#####\n#@$.x#\n#####", "outside XSB"),
    ],
)
def test_invalid_levels_are_rejected(xsb, message):
    with pytest.raises(LevelError, match=message):
        parse_xsb(xsb)


def test_bad_configuration_errors():
    with pytest.raises(ValueError, match="preset"):
        SokobanEnv(preset="huge")
    with pytest.raises(ValueError, match="max_solution_moves"):
        SokobanEnv(max_turns=5, max_solution_moves=8)
    with pytest.raises(ValueError, match="not both"):
        SokobanEnv(level="#####\n#@$.#\n#####", levels_file="x.xsb")


# -- Boxoban / XSB collections: turn limits, labels, bad input -----------------------------------
# Two levels in the layout of the Boxoban files (10x10, four boxes, numbered "; N" from 0).
BOXOBAN = """; 0

##########
#######  #
####   $ #
##     . #
## # ##$ #
#.  .$ @##
### $  .##
###    ###
##########
##########

; 1

##########
###    ###
###  $   #
#   .$.  #
#  ##*#  #
#  @ .   #
#    $   #
##########
##########
##########
"""


def test_boxoban_levels_get_at_least_120_turns_and_keep_their_numbers(tmp_path):
    from envs.sokoban.env import loaded_level_turns

    path = tmp_path / "boxoban.txt"
    path.write_text(BOXOBAN)
    env = gymnasium.make("freshper/Sokoban-v0", levels_file=str(path))
    obs, info = env.reset(options={"level_index": 1})
    inner = env.unwrapped
    assert info["level_label"] == "1" and info["level_index"] == 1
    assert inner.max_turns == loaded_level_turns(inner.level) >= 120 and "You have" in obs["text"]
    assert env.reset(options={"level_index": 0})[1]["level_label"] == "0"
    for turn in range(119):  # a 108-move solution fits: no truncation before turn 120
        _, _, terminated, truncated, _ = env.step("<answer>Up</answer>")
        assert not truncated, f"cut short at turn {turn + 1}"
    explicit = SokobanEnv(levels_file=str(path), max_turns=30)
    explicit.reset(seed=0)
    assert explicit.max_turns == 30
    single = SokobanEnv(level=BOXOBAN.split("; 1")[0].split("; 0")[1])
    single.reset(seed=0)
    assert single.max_turns >= 120


def test_a_malformed_level_is_named_by_its_header(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text(BOXOBAN.replace("#  @ .   #", "#    .   #"))  # level "; 1" loses its player
    with pytest.raises(LevelError, match=r"bad.txt: level 1: a level needs exactly one player"):
        SokobanEnv(levels_file=str(path))
    plain = tmp_path / "plain.xsb"
    plain.write_text("#####\n#@$.#\n#####\n\n#####\n#@$ #\n#####\n")  # no headers: counted from 1
    with pytest.raises(LevelError, match=r"plain.xsb: level 2: .*as many goals as boxes"):
        SokobanEnv(levels_file=str(plain))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(preset="hard", level="#####\n#@$.#\n#####"), "preset, size and num_boxes describe generated rooms"),
        (dict(num_boxes=-1), "num_boxes must be an integer >= 1, got -1"),
        (dict(num_boxes=0), "num_boxes must be an integer >= 1"),
        (dict(tile_size=-5), "tile_size must be an integer number of pixels >= 4, got -5"),
        (dict(size=3), "size must be an integer >= 4"),
        (dict(size=6, num_boxes=30), "30 boxes do not fit a 6x6 room"),
        (dict(max_turns=0), "max_turns must be an integer >= 1"),
    ],
)
def test_bad_settings_are_clear_errors_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gymnasium.make("freshper/Sokoban-v0", **kwargs)


def test_a_binary_or_missing_levels_file_is_a_clear_error(tmp_path):
    binary = tmp_path / "levels.xsb"
    binary.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(LevelError, match="is not a text file"):
        SokobanEnv(levels_file=str(binary))
    latin = tmp_path / "latin.xsb"
    latin.write_bytes("; Niveau à\n#####\n#@$.#\n#####\n".encode("latin-1"))
    with pytest.raises(LevelError, match=r"is not UTF-8 text \(byte 9"):
        SokobanEnv(levels_file=str(latin))
    with pytest.raises(LevelError, match="does not exist"):
        SokobanEnv(levels_file=str(tmp_path / "nowhere.xsb"))
    empty = tmp_path / "empty.xsb"
    empty.write_text("; only comments\nTitle: none\n")
    with pytest.raises(LevelError, match="no XSB level found"):
        SokobanEnv(levels_file=str(empty))


def test_a_large_collection_opens_fast_and_skips_a_malformed_level(tmp_path):
    import time

    good = BOXOBAN.split("; 1")[0].split("; 0")[1].strip("\n")
    broken = good.replace("@", " ")
    path = tmp_path / "large.txt"
    with path.open("w") as f:  # ~20 MB, ~170k levels (100 MB took > 200 s and 4 GB when parsed eagerly)
        for n in range(170_000):
            f.write(f"; {n}\n\n{broken if n == 7 else good}\n\n")
    start = time.perf_counter()
    env = SokobanEnv(levels_file=str(path))
    assert time.perf_counter() - start < 15
    assert len(env._levels) == 170_000 and env.image_shape == (10 * 28, 10 * 28, 3)
    start = time.perf_counter()
    others = [SokobanEnv(levels_file=str(path)) for _ in range(16)]  # a runner's batch of envs
    assert all(o._levels is env._levels for o in others) and time.perf_counter() - start < 1
    with pytest.raises(LevelError, match="large.txt: level 7: a level needs exactly one player"):
        env.reset(options={"level_index": 7})
    drawn = env._draw_level(7)
    assert drawn[0] == 8  # a seeded draw landing on the broken level takes the next good one
    _, info = env.reset(seed=1)
    assert info["level_label"] == str(info["level_index"])


def test_sokoban_by_length_scores_how_purposeful_the_moves_are():
    """experiments/sokoban/sokoban_by_length.py's aim numbers on hand-made boards: a step towards the box
    counts as closer, one away does not; a push towards the goal counts, a blocked move is left out."""
    from experiments.sokoban.sokoban_by_length import progress

    env = SokobanEnv(preset="simple", feedback=False, board="letters")
    far, _ = env.reset(options={"level": "#######\n#@  $.#\n#    #\n#######"})
    near, _ = env.reset(options={"level": "#######\n#  @$.#\n#    #\n#######"})
    turns = [(far["text"], "<answer>Right</answer>"), (far["text"], "<answer>Down</answer>"),
             (far["text"], "<answer>Left</answer>"),  # into the wall: not a step
             (near["text"], "<answer>Right</answer>"), (near["text"], "<answer>Left</answer>")]
    got = progress(turns)
    # plain steps: Right (closer), Down (farther), near-Left (farther) -> 1/3; one push, towards the goal
    assert got["towards_box"] == pytest.approx(1 / 3) and got["push_to_goal"] == 1.0 and got["pushes"] == 1


def test_sokoban_by_length_splits_the_solved_rate_by_how_purposeful_the_steps_were():
    """``--by-purpose``: an episode counts as purposeful when >= 3/4 of its plain steps go towards
    the box, aimless when < 1/2; one between, or without a plain step, counts in neither."""
    from experiments.sokoban.sokoban_by_length import solved_by_purpose

    env = SokobanEnv(preset="simple", feedback=False, board="letters")
    far, _ = env.reset(options={"level": "#######\n#@  $.#\n#    #\n#######"})
    towards, away = (far["text"], "<answer>Right</answer>"), (far["text"], "<answer>Down</answer>")
    episodes = [([towards, towards], True), ([towards, towards, towards, away], False), ([away, away], False),
                ([towards, away], True), ([(far["text"], "<answer>Left</answer>")], True)]  # 1/2; into the wall only
    got = solved_by_purpose(episodes)
    assert got["purposeful"] == (0.5, 2) and got["aimless"] == (0.0, 1)


def test_scripted_agents_push_towards_the_goal_and_walk_to_the_box_or_behind_it():
    """sokoban_by_length.py's scripted agents on hand-made boards: both push when the push brings
    the box closer to its goal; ``aim`` steps as its box words say, ``spot`` towards the cell
    behind the box, even where the aim's direction is a blocked push."""
    from experiments.sokoban.sokoban_by_length import scripted_move

    env = SokobanEnv(preset="simple", feedback=False, board="letters")
    rng = np.random.default_rng(0)
    far, _ = env.reset(options={"level": "#######\n#@  $.#\n#    #\n#######"})
    assert scripted_move(far["text"], "aim", rng) == "Right" and scripted_move(far["text"], "spot", rng) == "Right"
    behind, _ = env.reset(options={"level": "#######\n#  @$.#\n#    #\n#######"})
    assert scripted_move(behind["text"], "aim", rng) == "Right" and scripted_move(behind["text"], "spot", rng) == "Right"
    below, _ = env.reset(options={"level": "#######\n#   $.#\n#   @ #\n#######"})  # Up is a push into the wall
    assert {scripted_move(below["text"], "spot", rng) for _ in range(10)} == {"Left"}
    with pytest.raises(ValueError, match="aim, spot or subgoal"):
        scripted_move(far["text"], "plan", rng)


def test_aim_places_the_nearest_loose_box_from_the_player_and_the_nearest_free_goal_from_it():
    """``aim_words`` describes where things are: the box nearest the player that is not on a
    goal, then the free goal nearest that box; a box already on a goal is skipped."""
    from envs.sokoban.env import aim_words

    level = parse_xsb("#######\n#@ $  #\n#.    #\n#  *  #\n#.  $ #\n#######")
    boxes, goals, w = level.box_mask(), level.goals, level.width
    assert aim_words(boxes, goals, level.player, w) == " box Right goal Down Left"  # box (1,3) -> goal (2,1)
    moved = parse_xsb("#######\n#  $  #\n#.    #\n#  *  #\n#. @$ #\n#######")
    assert aim_words(moved.box_mask(), moved.goals, moved.player, w) == " box Right goal Left"  # (4,4), same row
    solved = parse_xsb("#####\n#@ *#\n#####")
    assert aim_words(solved.box_mask(), solved.goals, solved.player, solved.width) == " box none"


def test_aim_replies_write_the_aim_then_the_lookahead_and_the_diagnostics_score_both():
    """``--reasoning aim``: the pretraining's format replies think ``box .. goal .., <lookahead>``
    read off the live env, and the evaluation's diagnostics score each part against the
    board read back from the observation (a wrong aim leaves the lookahead exact)."""
    from envs.capabilities import reasoning_text, think_reply
    from envs.sokoban.env import aim_words, lookahead_words
    from learner.pretrain import TransitionStreams

    streams = TransitionStreams("freshper/Sokoban-v0", {"preset": "simple", "feedback": False, "board": "letters"},
                                n=8, seed=0, dynamics_fraction=0.5, with_images=False, reasoning="aim")
    try:
        formats = [ex for _ in range(4) for ex in streams.examples() if ex.kind == "format"]
    finally:
        streams.close()
    from envs.sokoban.env import parse_observed_board
    assert len(formats) > 8
    for ex in formats:
        think = ex.reply[len("<think>"):].split("</think>")[0]
        level = parse_observed_board(ex.text)
        boxes = level.box_mask()
        assert think == (aim_words(boxes, level.goals, level.player, level.width) + ","
                         + lookahead_words(level.walls, boxes, level.player, level.width))

    env = SokobanEnv(preset="simple", feedback=False, board="letters")
    turns, right_aims = [], 0
    for seed in range(6):
        obs, _ = env.reset(seed=seed)
        honest = seed % 2 == 0
        aim = env.aim_text() if honest else " box Up Up goal Up"
        turns.append((obs["text"], think_reply(aim + "," + env.lookahead_text(), "<answer>Up</answer>")))
        right_aims += honest
        assert reasoning_text(env, "aim") == env.aim_text() + "," + env.lookahead_text()
    d = SokobanEnv.turn_diagnostics(turns)
    assert d["aim_turns"] == 6 and d["aim_exact"] == pytest.approx(right_aims / 6)
    assert d["lookahead_turns"] == 6 and d["lookahead_exact"] == 1.0


def test_subgoal_names_the_nearest_push_spot_and_the_push_and_the_diagnostics_score_following_it():
    """``subgoal_words``: the floor cell behind the box from which a push brings it closer to
    its goal, seen from the player (``here`` on it), then that push; spots in a wall are
    skipped. The diagnostics score the words and whether the move does what they say."""
    from envs.capabilities import reasoning_text, think_reply
    from envs.sokoban.env import subgoal_words

    def words(xsb: str) -> str:
        level = parse_xsb(xsb)
        return subgoal_words(level.walls, level.box_mask(), level.goals, level.player, level.width)

    assert words("#######\n#@    #\n#  $ .#\n#     #\n#######") == " stand Down Right push Right"  # spot (2,2)
    assert words("#######\n#     #\n# @$ .#\n#     #\n#######") == " stand here push Right"
    assert words("#######\n# .   #\n#     #\n#  $  #\n#   @ #\n#######") == " stand Left push Up"  # spots (4,3) and (3,4) tie: the vertical push
    assert words("#######\n#.$  @#\n#######") == " stand Left push Left"
    assert words("####\n#.$#\n#@ #\n####") == " stand none"  # the spot behind the box is a wall
    assert words("#####\n#@ *#\n#####") == " box none"

    env = SokobanEnv(preset="simple", feedback=False, board="letters")
    turns, right, follow = [], 0, 0
    for seed in range(8):
        obs, _ = env.reset(seed=seed)
        plan = env.subgoal_text()
        assert reasoning_text(env, "subgoal") == plan + "," + env.lookahead_text()
        honest = seed % 2 == 0
        where, _, push = plan.strip()[len("stand"):].partition(" push ")
        named = push.strip() if where.strip() == "here" else where.split()[0]
        move = named if seed % 4 < 2 else next(m for m in _SOKO_ACTIONS if m not in where.split() and m != push.strip())
        said = plan if honest else " stand Up Up push Up"
        turns.append((obs["text"], think_reply(said + "," + env.lookahead_text(), f"<answer>{move}</answer>")))
        right += honest
        follow += seed % 4 < 2
    d = SokobanEnv.turn_diagnostics(turns)
    assert d["subgoal_turns"] == 8 and d["subgoal_exact"] == pytest.approx(right / 8)
    assert d["subgoal_followed"] == pytest.approx(follow / 8) and d["lookahead_exact"] == 1.0
    obs, _ = env.reset(seed=0)
    wrong = " stand Up Up push Up" if "Up" not in env.subgoal_text() else " stand Down Down push Down"
    named = wrong.split()[1]
    d = SokobanEnv.turn_diagnostics([(obs["text"], think_reply(wrong + "," + env.lookahead_text(), f"<answer>{named}</answer>"))])
    assert (d["subgoal_exact"], d["subgoal_followed"], d["subgoal_obeyed"]) == (0.0, 0.0, 1.0)  # does what its wrong words say


def test_subgoal_moves_are_the_push_on_the_spot_else_a_plain_step_the_words_name():
    """``subgoal_moves``: what a move that follows the subgoal words is (the pretraining's
    follow stage plays one): the push standing on the spot, a plain step in a ``stand``
    direction otherwise, none where the words name no spot or every named step hits a wall."""
    from envs.capabilities import think_reply
    from envs.sokoban.env import subgoal_moves

    def moves(xsb: str) -> list[str]:
        level = parse_xsb(xsb)
        return subgoal_moves(level.walls, level.box_mask(), level.goals, level.player, level.width)

    assert moves("#######\n#@    #\n#  $ .#\n#     #\n#######") == ["Down", "Right"]  # stand Down Right
    assert moves("#######\n#     #\n# @$ .#\n#     #\n#######") == ["Right"]  # here: the push
    assert moves("#######\n#.$  @#\n#######") == ["Left"]
    assert moves("####\n#.$#\n#@ #\n####") == []  # stand none
    assert moves("#####\n#@ *#\n#####") == []  # box none
    assert moves("#######\n#  $ .#\n##    #\n#@    #\n#######") == ["Right"]  # stand Up Right: Up is a wall
    env = SokobanEnv(preset="simple", feedback=False, board="letters")
    for seed in range(20):  # on generated levels every such move changes the state and follows the words
        obs, _ = env.reset(seed=seed)
        plan = env.subgoal_text()
        for move in env.subgoal_moves():
            assert move in env.effective_actions()
            reply = think_reply(plan + "," + env.lookahead_text(), f"<answer>{move}</answer>")
            assert SokobanEnv.turn_diagnostics([(obs["text"], reply)])["subgoal_followed"] == 1.0


def test_the_follow_stage_plays_the_moves_the_words_name_and_leaves_the_first_stage_alone():
    """``TransitionStreams(follow_fraction=1)``: every format reply whose board has a move that
    follows the subgoal words plays one; with the default 0 the stream is the one of before
    (no extra draw)."""
    from envs.sokoban.env import parse_observed_board, subgoal_moves
    from learner.pretrain import TransitionStreams

    kwargs = {"preset": "simple", "feedback": False, "board": "letters"}

    def formats(follow: float) -> list:
        streams = TransitionStreams("freshper/Sokoban-v0", kwargs, n=8, seed=0, dynamics_fraction=0.5,
                                    with_images=False, reasoning="subgoal", follow_fraction=follow)
        try:
            return [ex for _ in range(6) for ex in streams.examples()]
        finally:
            streams.close()

    followed, named = 0, 0
    for ex in formats(1.0):
        if ex.kind != "format":
            continue
        level = parse_observed_board(ex.text)
        moves = subgoal_moves(level.walls, level.box_mask(), level.goals, level.player, level.width)
        move = ex.reply.split("<answer>")[1].split("</answer>")[0]
        named += bool(moves)
        followed += move in moves
        if moves:
            assert move in moves
    assert named > 10 and followed == named
    base = formats(0.0)
    streams = TransitionStreams("freshper/Sokoban-v0", kwargs, n=8, seed=0, dynamics_fraction=0.5,
                                with_images=False, reasoning="subgoal")
    try:
        assert [ex.reply for _ in range(6) for ex in streams.examples()] == [ex.reply for ex in base]
    finally:
        streams.close()
    random_follow = []
    for ex in base:
        if ex.kind == "format":
            level = parse_observed_board(ex.text)
            moves = subgoal_moves(level.walls, level.box_mask(), level.goals, level.player, level.width)
            if moves:
                random_follow.append(ex.reply.split("<answer>")[1].split("</answer>")[0] in moves)
    assert np.mean(random_follow) < 0.8  # random moves follow the words far less often
