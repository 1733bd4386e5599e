"""FrozenLake: parity with gymnasium's FrozenLake-v1, parsing, notation, images, defaults."""

from __future__ import annotations

import numpy as np
import pytest
import gymnasium as gym
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from gymnasium.utils import seeding

import envs  # noqa: F401  (registers the tasks)
from envs.base import IMAGE_PLACEHOLDER
from envs.frozenlake import ACTIONS, MAPS, TILE, FrozenLakeEnv, FrozenLakeVisionEnv, random_map

GYM_TO_REPLY = [FrozenLakeEnv.format_reply(a) for a in range(4)]


def _gym_lake(desc: list[str], slippery: bool) -> gym.Env:
    return gym.make("FrozenLake-v1", desc=desc, is_slippery=slippery).unwrapped


@pytest.mark.parametrize("size,p,seed", [(4, 0.8, 0), (4, 0.8, 7), (6, 0.6, 3), (8, 0.8, 11)])
def test_random_map_matches_gymnasium_generator(size: int, p: float, seed: int) -> None:
    rng, _ = seeding.np_random(seed)
    assert random_map(rng, size, p) == generate_random_map(size, p, seed)


@pytest.mark.parametrize("slippery", [False, True])
def test_transitions_match_gymnasium_frozenlake(slippery: bool) -> None:
    """Same map, same actions (and, when slippery, the same RNG stream) -> same states and rewards."""
    actions_rng = np.random.default_rng(123)
    checked = slips = 0
    for seed in range(60):
        ours = FrozenLakeEnv(is_slippery=slippery, max_turns=100)
        ours.reset(seed=seed)
        theirs = _gym_lake(ours.desc, slippery)
        theirs.reset(seed=seed)
        # Slippery draws: give gymnasium a generator in the same state as ours.
        theirs.np_random = np.random.Generator(np.random.PCG64())
        theirs.np_random.bit_generator.state = ours.np_random.bit_generator.state
        for _ in range(40):
            a = int(actions_rng.integers(4))
            s, r_gym, term_gym, _, _ = theirs.step(a)
            obs, r, term, trunc, info = ours.step(GYM_TO_REPLY[a])
            slips += "slipped" in obs["text"]
            assert info["action_is_valid"]
            assert ours.pos == divmod(int(s), ours.ncol)
            assert (r, term) == (float(r_gym), term_gym)
            assert info["success"] == (term and ours.desc[ours.pos[0]][ours.pos[1]] == "G")
            checked += 1
            if term or trunc:
                break
    assert checked > 200
    assert (slips > 30) if slippery else (slips == 0)


def test_default_is_4x4_not_slippery_with_8_turns() -> None:
    env = gym.make("freshper/FrozenLake-v0").unwrapped
    assert (env.nrow, env.ncol, env.is_slippery, env.max_turns) == (4, 4, False, 8)
    assert env.format_penalty == pytest.approx(-0.1)


def test_new_random_map_each_reset_and_seeded_determinism() -> None:
    env = FrozenLakeEnv()
    maps = {tuple(env.reset(seed=s)[1]["map"]) for s in range(20)}
    assert len(maps) > 10
    first = env.reset(seed=5)[0]["text"]
    env.reset(seed=6)
    assert env.reset(seed=5)[0]["text"] == first


def test_fixed_map_desc_and_map_name() -> None:
    env = FrozenLakeEnv(map_name="8x8")
    assert env.reset(seed=0)[1]["map"] == MAPS["8x8"] == env.reset(seed=1)[1]["map"]
    desc = ["SH", "FG"]
    env = FrozenLakeEnv(desc=desc)
    env.reset(seed=0)
    assert env.max_turns == 4
    assert env.step("<answer>Right</answer>")[1:3] == (0.0, True)  # hole
    env.reset(seed=0)
    env.step("<answer>Down</answer>")
    _, reward, terminated, _, info = env.step("<answer>Right</answer>")
    assert (reward, terminated, info["success"]) == (1.0, True, True)
    with pytest.raises(ValueError, match="map_name"):
        FrozenLakeEnv(map_name="5x5")
    with pytest.raises(ValueError, match="S, F, H, G"):
        FrozenLakeEnv(desc=["SX", "FG"])


def test_text_observation_is_short_board_with_player() -> None:
    env = FrozenLakeEnv(desc=MAPS["4x4"], render_mode="ansi")
    obs, info = env.reset(seed=0)
    board = " P F F F\n F H F H\n F F F H\n H F F G"  # every cell after a space: one token per cell kind
    assert obs["text"] == f"{info['instructions']}\n\n{board}"
    assert env.render() == board
    assert len(info["instructions"].split()) < 40 and info["instructions"].count(".") <= 3
    env.step("<answer>Right</answer>")
    assert env.render().splitlines()[0] == " S P F F"


def test_feedback_false_observes_the_board_alone() -> None:
    with_fb, without = FrozenLakeEnv(desc=MAPS["4x4"]), FrozenLakeEnv(desc=MAPS["4x4"], feedback=False)
    assert with_fb.reset(seed=0)[0] == without.reset(seed=0)[0]  # the first observation is unchanged
    for reply in ("<answer>Right</answer>", "no tag", "<answer>Down</answer>"):
        a, b = with_fb.step(reply), without.step(reply)
        assert a[1:] == b[1:]  # same dynamics, rewards and info
        assert b[0]["text"] == without.board_text()
        assert a[0]["text"] != b[0]["text"] and without.board_text() in a[0]["text"]


def test_off_board_move_stays_in_place() -> None:
    env = FrozenLakeEnv(desc=MAPS["4x4"])
    env.reset(seed=0)
    obs, reward, terminated, _, info = env.step("<answer>Up</answer>")
    assert env.pos == (0, 0) and info["action_is_valid"] and not terminated and reward == 0.0
    assert "edge" in obs["text"]


@pytest.mark.parametrize(
    "reply,expected",
    [
        ("<answer>Down</answer>", 1),
        ("<ANSWER> left </ANSWER>", 0),
        ("think... <answer>RIGHT</answer>", 2),
        ("<answer>u</answer>", 3),
        ("<answer>Up</answer> then <answer>Down</answer>", 1),  # the last complete tag wins
    ],
)
def test_parse_valid_replies(reply: str, expected: int) -> None:
    assert FrozenLakeEnv().parse_action(reply) == (expected, None)


@pytest.mark.parametrize("reply", ["Down", "<answer>Down", "<answer>go down</answer>", "<answer></answer>", "<answer>x</answer>"])
def test_parse_invalid_replies_explain(reply: str) -> None:
    action, error = FrozenLakeEnv().parse_action(reply)
    assert action is None and "answer" in error.lower()


def test_invalid_reply_costs_penalty_and_keeps_state() -> None:
    env = FrozenLakeEnv(format_penalty=-0.5)
    env.reset(seed=1)
    before = env.board_text()
    obs, reward, terminated, truncated, info = env.step("I go down")
    assert (reward, terminated, truncated, info["action_is_valid"]) == (-0.5, False, False, False)
    assert env.board_text() == before and obs["text"].startswith("Invalid reply")


def test_truncates_after_max_turns() -> None:
    env = FrozenLakeEnv(desc=MAPS["4x4"], max_turns=3)
    env.reset(seed=0)
    for _ in range(2):
        assert env.step("<answer>Up</answer>")[3] is False
    _, _, terminated, truncated, info = env.step("<answer>Up</answer>")
    assert (terminated, truncated, info["success"]) == (False, True, False)


def test_legal_actions_and_format_reply() -> None:
    env = FrozenLakeEnv(desc=MAPS["4x4"])
    env.reset(seed=0)
    assert env.legal_actions() == ["Down", "Right"]
    env.pos = (3, 3)
    assert env.legal_actions() == ["Left", "Up"]
    assert FrozenLakeEnv.format_reply(1) == "<answer>Down</answer>" == FrozenLakeEnv.format_reply("down")
    assert [env.parse_action(FrozenLakeEnv.format_reply(a))[0] for a in ACTIONS] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        FrozenLakeEnv.format_reply("jump")


def test_vision_shares_dynamics_and_draws_28px_tiles() -> None:
    text_env, vis_env = FrozenLakeEnv(), FrozenLakeVisionEnv(render_mode="rgb_array")
    obs_t, _ = text_env.reset(seed=9)
    obs_v, _ = vis_env.reset(seed=9)
    assert obs_v["text"].count(IMAGE_PLACEHOLDER) == 1 and "F F" not in obs_v["text"]
    assert obs_v["image"].shape == (4 * TILE, 4 * TILE, 3) == (112, 112, 3) and obs_v["image"].dtype == np.uint8
    assert vis_env.render_text() == text_env.board_text()
    for a in [1, 2, 1, 2, 1, 2]:
        r1 = text_env.step(GYM_TO_REPLY[a])
        r2 = vis_env.step(GYM_TO_REPLY[a])
        assert r1[1:4] == r2[1:4] and text_env.pos == vis_env.pos
        assert np.array_equal(r2[0]["image"], vis_env.render())
        if r1[2]:
            break


def test_tiles_are_distinct_per_cell_kind() -> None:
    env = FrozenLakeVisionEnv(desc=["SFH", "FFG"])
    image = env.reset(seed=0)[0]["image"]
    tile = lambda r, c: image[r * TILE : (r + 1) * TILE, c * TILE : (c + 1) * TILE]  # noqa: E731
    kinds = [tile(0, 0), tile(0, 1), tile(0, 2), tile(1, 2), tile(1, 1)]  # player-on-S, F, H, G, F
    assert np.array_equal(kinds[1], kinds[4])
    for i in range(4):
        for j in range(i + 1, 4):
            assert not np.array_equal(kinds[i], kinds[j])


# -- the safe-move probe as the env contract's turn_diagnostics -----------------------------------
def _played_turns(size: int, episodes: int, feedback: bool, seed: int = 0) -> list[tuple[str, str]]:
    """(observation, reply) of random play with replies in the forms a model writes."""
    env = FrozenLakeEnv(size=size, feedback=feedback)
    rng = np.random.default_rng(seed)
    forms = ["<answer>{}</answer>", "<answer>{}</answer>", "I go <ANSWER> {} </ANSWER>", "<answer>{}</answer>",
             "<answer>{}.</answer>", "no tag {}", "<answer>{}</answer>"]
    turns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed * 1000 + ep)
        done = False
        while not done:
            move = ACTIONS[int(rng.integers(4))]
            word = move if rng.random() < 0.7 else move[0].lower()
            reply = forms[int(rng.integers(len(forms)))].format(word)
            turns.append((obs["text"], reply))
            obs, _, term, trunc, _ = env.step(reply)
            done = term or trunc
    return turns

def _reference_board_probe(records) -> dict[str, float]:
    """The safe-move probe as first written for 4x4 evaluation records (regex over the text)."""
    import re

    row_re = re.compile(r"^[SFHGP]( [SFHGP])+$")
    answer_re = re.compile(r"<answer>\s*([A-Za-z]+)\s*</answer>", re.IGNORECASE)
    safe = unsafe = other = 0
    for rec in records:
        for turn in rec.turns:
            blocks, current = [], []
            for line in turn.observation.splitlines():
                if row_re.match(line.strip()):
                    current.append(line.strip())
                elif current:
                    blocks.append(current)
                    current = []
            if current:
                blocks.append(current)
            if not blocks:
                continue
            board = [r.split(" ") for r in blocks[-1]]
            if any(len(r) != len(board[0]) for r in board):
                continue
            where = [(r, c) for r, row in enumerate(board) for c, ch in enumerate(row) if ch == "P"]
            if len(where) != 1:
                continue
            r, c = where[0]
            if r + 1 >= len(board) or c + 1 >= len(board[0]):
                continue
            down_hole, right_hole = board[r + 1][c] == "H", board[r][c + 1] == "H"
            if down_hole == right_hole:
                continue
            m = answer_re.search(turn.reply or "")
            move = {"d": "down", "down": "down", "r": "right", "right": "right"}.get(m.group(1).lower() if m else "")
            if move is None:
                other += 1
            elif (move == "down") != down_hole:
                safe += 1
            else:
                unsafe += 1
    n = safe + unsafe
    return {"probe_states": float(n + other), "probe_down_right": float(n),
            "probe_safe_rate": safe / n if n else float("nan")}


@pytest.mark.parametrize(("size", "feedback"), [(4, False), (4, True), (8, False), (6, True)])
def test_turn_diagnostics_give_the_numbers_of_the_reports_board_probe(size: int, feedback: bool) -> None:
    from types import SimpleNamespace

    turns = _played_turns(size, episodes=150, feedback=feedback, seed=size)
    records = [SimpleNamespace(turns=[SimpleNamespace(observation=o, reply=r) for o, r in turns])]
    ours, theirs = envs.task_class("freshper/FrozenLake-v0").turn_diagnostics(turns), _reference_board_probe(records)
    assert set(ours) == {"probe_states", "probe_down_right", "probe_safe_rate"}
    assert ours == pytest.approx(theirs, nan_ok=True)
    assert ours["probe_down_right"] > 20  # the sample exercises the probe


def test_turn_diagnostics_count_safe_unsafe_and_other_replies_on_any_board_shape() -> None:
    # 3x5 board: P at (0,0), a hole below, ice to the right -> Right is safe.
    desc = ["SFFFF", "HFHFF", "FFFFG"]
    env = FrozenLakeEnv(desc=desc)
    board = env.reset(seed=0)[0]["text"]
    turns = [(board, "<answer>Right</answer>"), (board, "<answer>r</answer>"), (board, "<answer>Down</answer>"),
             (board, "<answer>Up</answer>"), (board, "garbage"), ("no board here", "<answer>Right</answer>"),
             (IMAGE_PLACEHOLDER, "<answer>Down</answer>")]
    out = FrozenLakeEnv.turn_diagnostics(turns)
    assert out == {"probe_states": 5.0, "probe_down_right": 3.0, "probe_safe_rate": pytest.approx(2 / 3)}
    # The move counted is the one the env executes: the last answer tag.
    assert FrozenLakeEnv.turn_diagnostics([(board, "<answer>Down</answer> no, <answer>Right</answer>")])[
        "probe_safe_rate"] == 1.0
    assert np.isnan(FrozenLakeEnv.turn_diagnostics([])["probe_safe_rate"])
    assert FrozenLakeVisionEnv.turn_diagnostics(turns) == out  # a class method: the text decides


def test_settings_that_almost_never_give_a_solvable_map_are_rejected_not_looped_on() -> None:
    import time

    from envs.frozenlake import MapGenerationError

    start = time.perf_counter()
    with pytest.raises(MapGenerationError, match="size=8, p=0.05 almost never give a solvable map.*raise p"):
        gym.make("freshper/FrozenLake-v0", p=0.05, size=8).reset(seed=0)
    assert time.perf_counter() - start < 5
    with pytest.raises(MapGenerationError, match="in 10 draws"):  # the redraw itself is bounded too
        random_map(np.random.default_rng(0), 8, 0.05, max_draws=10)
    env = gym.make("freshper/FrozenLake-v0", p=0.35, size=8)  # rare but drawable: accepted, and resets
    assert env.reset(seed=0)[0]["text"]


def test_hole_reward_scores_a_fall_and_leaves_success_and_the_goal_alone() -> None:
    from envs.frozenlake import FrozenLakeEnv

    desc = ["SHFF", "FFFF", "FFFF", "FFFG"]
    env = FrozenLakeEnv(desc=desc, hole_reward=-1.0)
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("<answer>Right</answer>")
    assert (reward, terminated, info["success"]) == (-1.0, True, False)
    env.reset(seed=0, options={"position": [3, 2]})
    assert env.step("<answer>Right</answer>")[1] == 1.0
    plain = FrozenLakeEnv(desc=desc)
    plain.reset(seed=0)
    assert plain.step("<answer>Right</answer>")[1] == 0.0  # gymnasium's reward by default
    with pytest.raises(ValueError, match="hole_reward"):
        FrozenLakeEnv(hole_reward=float("nan"))
