"""Pretraining on a task's own transitions, through the env contract, for every registered task;
turn-level advantages; the policy diagnostics."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import envs
from agents.record import Sample, Trajectory, Turn, load_records, save_records
from learner.advantages import assign_step_advantages
from learner.pretrain import PretrainSettings, TransitionStreams, has_random_replies, pretrain, pretrained_default

# Tasks whose optional package (reasoning-gym, gem-llm) is not installed are skipped, with the hint.
TASKS = [pytest.param(s.id, id=s.id, marks=pytest.mark.skipif(not s.available, reason=s.missing_message()))
         for s in envs.registered_tasks() if s.source == "freshper" and not s.needs]


@pytest.mark.parametrize("env_id", TASKS)
def test_every_task_draws_well_formed_random_replies(env_id: str) -> None:
    env = envs.make(env_id)
    rng = np.random.default_rng(0)
    assert has_random_replies(env)
    for seed in range(3):
        env.reset(seed=seed)
        for _ in range(4):
            obs, _, term, trunc, info = env.step(env.unwrapped.sample_reply(rng))
            assert info["action_is_valid"], f"{env_id}: a sampled reply was invalid"
            if term or trunc:
                break
    env.close()


@pytest.mark.parametrize("env_id", TASKS)
def test_transition_examples_are_the_task_prompts_with_a_move_or_a_reply(env_id: str) -> None:
    vision = envs.task_spec(env_id).modality == "vision"
    streams = TransitionStreams(env_id, {}, n=8, seed=1, dynamics_fraction=0.5, with_images=vision)
    try:
        examples = streams.examples() + streams.examples() + streams.examples()
    finally:
        streams.close()
    kinds = {ex.kind for ex in examples}
    assert kinds == {"dynamics", "format"}
    for ex in examples:
        assert ex.text.count(IMAGE) == len(ex.images) == (1 if vision else 0)
        if ex.kind == "dynamics":
            assert "\nMove: " in ex.text and ex.reply.startswith("<answer>") and ex.reply.endswith("</answer>")
        else:
            assert "\nMove: " not in ex.text
            assert envs.make(env_id).unwrapped.parse_action(ex.reply)[1] is None


IMAGE = envs.IMAGE_PLACEHOLDER


def test_frozenlake_dynamics_targets_are_the_next_board_or_how_it_ended() -> None:
    streams = TransitionStreams("freshper/FrozenLake-v0", {"feedback": False}, n=16, seed=0, dynamics_fraction=1.0,
                                with_images=False)
    try:
        targets = [ex.reply for _ in range(12) for ex in streams.examples()]
    finally:
        streams.close()
    boards = [t for t in targets if t.count("\n") == 3]
    assert boards and all(t[len("<answer>"):-len("</answer>")].count(" P") == 1 for t in boards)
    assert "<answer>hole</answer>" in targets  # random walks fall in
    assert set(targets) - set(boards) <= {"<answer>hole</answer>", "<answer>goal</answer>"}


def test_sokoban_dynamics_examples_include_blocked_moves_and_frozenlake_draws_nothing_extra() -> None:
    """Sokoban's random replies are effective moves (test_sokoban checks them), while its
    dynamics examples draw every legal move, so some show a blocked move leaving the board as it
    was; FrozenLake's stream draws nothing extra (its legal moves are its effective moves)."""
    from learner.pretrain import _dynamics_reply

    kwargs = {"preset": "simple", "feedback": False, "board": "letters"}
    streams = TransitionStreams("freshper/Sokoban-v0", kwargs, n=16, seed=0, dynamics_fraction=1.0, with_images=False)
    try:
        examples = [ex for _ in range(6) for ex in streams.examples()]
    finally:
        streams.close()
    boards = [ex for ex in examples if ex.reply != "<answer>solved</answer>"]
    unchanged = sum(ex.reply[len("<answer>"):-len("</answer>")] == ex.text.rsplit("Board:\n", 1)[1].split("\nMove:")[0]
                    for ex in boards)
    assert 0 < unchanged < len(boards)  # blocked moves leave the board as shown; the others move
    fl = envs.make("freshper/FrozenLake-v0").unwrapped
    fl.reset(seed=0)
    rng = np.random.default_rng(5)
    state = rng.bit_generator.state
    assert _dynamics_reply(fl, "<answer>Down</answer>", rng) == "<answer>Down</answer>"
    assert rng.bit_generator.state == state  # no draw: FrozenLake's pretraining stream is unchanged


def test_pretraining_lowers_the_dynamics_loss_and_is_cached(tmp_path) -> None:
    cfg = PretrainSettings(steps=25, batch=16, lr=3e-3)
    path, report = pretrained_default("freshper/FrozenLake-v0", {"feedback": False}, cfg, seed=0, cache_dir=tmp_path)
    assert not report["cached"] and report["pretrain_steps"] == 25
    assert report["pretrain_dynamics_nll_after"] < 0.7 * report["pretrain_dynamics_nll_before"]
    assert report["pretrain_format_nll_after"] < report["pretrain_format_nll_before"]
    again, report2 = pretrained_default("freshper/FrozenLake-v0", {"feedback": False}, cfg, seed=0, cache_dir=tmp_path)
    assert again == path and report2["cached"]
    other, _ = pretrained_default("freshper/FrozenLake-v0", {"feedback": False}, dataclasses.replace(cfg, steps=1),
                                  seed=0, cache_dir=tmp_path)
    assert other != path  # the recipe is part of the cache key


def test_exact_rate_counts_the_replies_the_policy_writes_to_the_character(tmp_path) -> None:
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from learner.pretrain import exact_rate, held_out_dynamics

    policy = Policy.from_pretrained(build_tiny_model("text", cache_dir=tmp_path))
    examples = held_out_dynamics("freshper/FrozenLake-v0", {"feedback": False}, 0, False, streams=6, rounds=1)
    assert len(examples) == 6 and all(ex.kind == "dynamics" for ex in examples)
    assert exact_rate(policy, examples) == 0.0  # an untrained model writes no board
    gens = policy.generate([policy.chat.first_message(ex.text, ex.images) for ex in examples],
                           [ex.images for ex in examples], max_new_tokens=12, greedy=True)
    own = [dataclasses.replace(ex, reply=policy.reply_text(g.token_ids).strip()) for ex, g in zip(examples, gens)]
    assert exact_rate(policy, own) == 1.0  # its own greedy replies, as targets
    own[0] = dataclasses.replace(own[0], reply=own[0].reply + "x")
    assert exact_rate(policy, own) == pytest.approx(5 / 6)


def test_pretraining_goes_on_in_rounds_until_the_bar_or_the_step_cap(tmp_path) -> None:
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    policy = Policy.from_pretrained(build_tiny_model("text", cache_dir=tmp_path))
    cfg = PretrainSettings(steps=3, batch=4, lr=3e-3, until_exact=1.0, max_steps=7, check_every=2)
    report = pretrain(policy, "freshper/FrozenLake-v0", {"feedback": False}, cfg, seed=0)
    assert report["pretrain_steps"] == 7 and not report["pretrain_reached_bar"]  # a 7-step model writes no board
    assert [step for step, _ in report["pretrain_exact_checks"]] == [3, 5, 7]
    assert report["pretrain_dynamics_exact_after"] == report["pretrain_exact_checks"][-1][1] == 0.0
    off = pretrain(policy, "freshper/FrozenLake-v0", {"feedback": False}, PretrainSettings(steps=2, batch=4), seed=0)
    assert off["pretrain_steps"] == 2 and "pretrain_exact_checks" not in off and "pretrain_dynamics_exact_after" in off


def test_pretraining_stops_at_the_first_check_that_meets_the_bar(tmp_path, monkeypatch) -> None:
    """Reaching the bar takes hundreds of steps; the rates the checks see are fed in here, the
    training between them is real."""
    import learner.pretrain as lp
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    rates = iter([0.1, 0.3, 0.6, 0.9])
    monkeypatch.setattr(lp, "exact_rate", lambda policy, examples: next(rates))
    policy = Policy.from_pretrained(build_tiny_model("text", cache_dir=tmp_path))
    cfg = PretrainSettings(steps=2, batch=4, until_exact=0.5, max_steps=20, check_every=3)
    report = lp.pretrain(policy, "freshper/FrozenLake-v0", {"feedback": False}, cfg, seed=0)
    assert report["pretrain_exact_checks"] == [[2, 0.1], [5, 0.3], [8, 0.6]]
    assert report["pretrain_steps"] == 8 and report["pretrain_reached_bar"]
    assert report["pretrain_dynamics_exact_after"] == 0.6


def test_the_bar_is_part_of_the_cache_key_and_checked() -> None:
    from pathlib import Path

    from learner.pretrain import cache_key

    base = Path("tiny-text-s0-x")
    plain = PretrainSettings()
    keys = {cache_key(base, "freshper/FrozenLake-v0", {}, c, 0)
            for c in (plain, PretrainSettings(until_exact=0.5), PretrainSettings(until_exact=0.5, max_steps=800))}
    assert len(keys) == 3
    for bad in ({"until_exact": 1.5}, {"until_exact": 0.5, "max_steps": 100}, {"check_every": 0}):
        with pytest.raises(ValueError):
            PretrainSettings(**bad)


def test_vision_pretraining_sees_the_image_and_predicts_the_board_text(tmp_path) -> None:
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model

    policy = Policy.from_pretrained(build_tiny_model("vision", cache_dir=tmp_path))
    torch.manual_seed(0)
    report = pretrain(policy, "freshper/FrozenLakeVision-v0", {"feedback": False},
                      PretrainSettings(steps=3, batch=4, lr=3e-3), seed=0)
    assert report["pretrain_steps"] == 3 and np.isfinite(report["pretrain_loss_last"])
    assert report["pretrain_dynamics_nll_after"] < report["pretrain_dynamics_nll_before"]


# -- turn-level credit ---------------------------------------------------------------------------
def _record(group: int, observations: list[str], rewards: list[float], advantage: float,
            prompts: list[list[int]] | None = None, context: str = "window:0") -> Trajectory:
    """A record whose turn i saw ``observations[i]`` through the prompt ``prompts[i]`` (by default
    one prompt id per distinct observation, as a window:0 prompt of that state would be)."""
    turns = [Turn(o, "<answer>Down</answer>", r, True) for o, r in zip(observations, rewards)]
    prompts = prompts or [[100 + sum(map(ord, o))] for o in observations]
    samples = [Sample(p + [2, 3], [0] * len(p) + [1, 1], [0.0] * len(p) + [-0.5, -0.5]) for p in prompts]
    return Trajectory("x/Y-v0", 0, group, turns, samples, sum(rewards), False, 0, advantage=advantage, context=context)


def test_step_advantages_normalise_return_to_go_among_identical_states_of_a_group() -> None:
    a = _record(0, ["s0", "s1"], [0.0, 1.0], advantage=1.0)  # from s0: return-to-go 0.5 (gamma 0.5)
    b = _record(0, ["s0", "s2"], [0.0, 0.0], advantage=-1.0)  # from s0: 0
    c = _record(1, ["s0"], [0.0], advantage=0.0)  # another group: s0 is a different anchor there
    assign_step_advantages([a, b, c], gamma=0.5, weight=2.0)
    # s0 in group 0: step returns (0.5, 0) -> normalised (+1, -1), weighted by 2
    assert a.samples[0].advantage == pytest.approx(1.0 + 2.0, abs=1e-4)  # eps in the std
    assert b.samples[0].advantage == pytest.approx(-1.0 - 2.0, abs=1e-4)
    # states seen once get only the episode advantage
    assert a.samples[1].advantage == pytest.approx(1.0) and b.samples[1].advantage == pytest.approx(-1.0)
    assert c.samples[0].advantage == pytest.approx(0.0)


def test_a_window0_first_turn_joins_later_visits_to_its_board() -> None:
    """Turn 0's observation text also holds the instructions; in window:0 its prompt is the same
    as a later turn's on the same board, and the anchor is the prompt."""
    start, moved = [7, 8, 9], [7, 8, 5]
    a = _record(0, ["rules\n\nB0", "B0", "B1"], [-0.1, -0.1, 1.0], 0.0, prompts=[start, start, moved])  # a no-op first
    b = _record(0, ["rules\n\nB0", "B1"], [-0.1, 1.0], 0.0, prompts=[start, moved])
    assign_step_advantages([a, b], gamma=0.9, weight=1.0)
    # B0 seen three times: the no-op turn 0 of a has the lowest return-to-go, so a negative step advantage
    assert a.samples[0].advantage < 0 < b.samples[0].advantage
    assert a.samples[0].advantage < a.samples[1].advantage
    assert a.samples[1].advantage != pytest.approx(0.0)
    # window:1 records (prompts hold history) anchor on the observation text: the later visit to
    # B0 (text "B0") is not in turn 0's group ("rules\n\nB0"), so it is alone there
    c = _record(0, ["rules\n\nB0", "B0", "B1"], [-0.1, -0.1, 1.0], 0.0, prompts=[start, start, moved], context="window:1")
    d = _record(0, ["rules\n\nB0", "B1"], [-0.1, 1.0], 0.0, prompts=[start, moved], context="window:1")
    assign_step_advantages([c, d], gamma=0.9, weight=1.0)
    assert c.samples[1].advantage == pytest.approx(0.0)
    assert c.samples[0].advantage < 0 < d.samples[0].advantage


def test_per_sample_advantages_survive_records_on_disk_and_replay_blobs(tmp_path) -> None:
    rec = _record(0, ["s0", "s1"], [0.0, 1.0], advantage=0.5)
    rec.samples[0].advantage = 1.25
    back = Trajectory.from_bytes(rec.to_bytes())
    assert [s.advantage for s in back.samples] == [1.25, None]
    save_records([rec], tmp_path)
    assert [s.advantage for s in load_records(tmp_path)[0].samples] == [1.25, None]


def test_step_advantages_reach_the_loss_through_the_batch() -> None:
    from learner.batch import make_batches

    rec = _record(0, ["s0", "s1"], [0.0, 1.0], advantage=0.5)
    rec.samples[1].advantage = -2.0
    (batch,) = make_batches([rec])
    assert batch.advantages.tolist() == [0.5, -2.0]


# -- diagnostics -----------------------------------------------------------------------------------
def test_frozenlake_counterfactual_probes_differ_only_below_and_right_of_the_player() -> None:
    env = envs.make("freshper/FrozenLake-v0")
    probes = env.unwrapped.counterfactual_probes(np.random.default_rng(0), 20)
    assert len(probes) == 20
    for a, b, action in probes:
        assert action == "Down" and a["position"] == b["position"]
        r, c = a["position"]
        diff = {(i, j) for i, (ra, rb) in enumerate(zip(a["desc"], b["desc"])) for j in range(len(ra)) if ra[j] != rb[j]}
        assert diff == {(r + 1, c), (r, c + 1)}
        assert a["desc"][r + 1][c] == "H" and b["desc"][r][c + 1] == "H"
        obs, _ = env.reset(seed=0, options=a)
        assert env.unwrapped.pos == (r, c)


def test_sokoban_counterfactual_probes_wall_off_one_cell_next_to_the_player() -> None:
    """State a has a wall where state b has plain floor, next to the player; the favoured move
    does nothing in a and moves in b; nothing else differs, and the env plays the given board."""
    env = envs.make("freshper/Sokoban-v0", preset="simple", feedback=False, board="letters")
    probes = env.unwrapped.counterfactual_probes(np.random.default_rng(0), 24)
    assert len(probes) == 24 and len({action for _, _, action in probes}) == 4
    for a, b, action in probes:
        rows_a, rows_b = a["level"].split("\n"), b["level"].split("\n")
        diff = [(i, j) for i, (ra, rb) in enumerate(zip(rows_a, rows_b)) for j in range(max(len(ra), len(rb)))
                if ra[j:j + 1] != rb[j:j + 1]]
        assert len(diff) == 1 and rows_a[diff[0][0]][diff[0][1]] == "#" and rows_b[diff[0][0]][diff[0][1]] == " "
        obs, _ = env.reset(seed=0, options=a)
        assert action not in env.unwrapped.effective_actions() and env.unwrapped.render_text() == a["level"]
        assert " w" in obs["text"] and "#" not in obs["text"]  # shown in the env's notation
        env.reset(seed=0, options=b)
        assert action in env.unwrapped.effective_actions()
        _, _, _, _, info = env.step(env.unwrapped.format_reply(action))
        assert "nothing changed" not in info.get("feedback", "")
    with pytest.raises(Exception, match="XSB level as a string"):
        env.reset(seed=0, options={"level": 3})


def test_a_board_blind_policy_has_no_spread_and_no_counterfactual_shift() -> None:
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from learner.diagnostics import policy_diagnostics
    from tests.conftest import with_logit_bias

    base = Policy.from_pretrained(build_tiny_model("text"))
    vocab = base.tokenizer.get_vocab()
    # Whatever the board, the reply is <answer>Down</answer>: every token of it is pushed up hard.
    ids = base.encode_reply("<answer>Down</answer>")
    blind = with_logit_bias(base, {t: 60.0 for t in ids})
    out = policy_diagnostics(blind, "freshper/FrozenLake-v0", {"feedback": False}, states=12, probes=12)
    assert out["action_spread"] < 1e-3 and abs(out["counterfactual_shift"]) < 1e-3
    loose = policy_diagnostics(base, "freshper/FrozenLake-v0", {"feedback": False}, states=12, probes=12)
    assert loose["action_spread"] > out["action_spread"]  # a random network's output does move with the board
    assert "<answer>" in vocab
    # Sokoban's wall-or-floor pairs: the blind policy's shift is 0 and so is its interval
    right = with_logit_bias(base, {t: 60.0 for t in base.encode_reply("<answer>Right</answer>")})
    soko = policy_diagnostics(right, "freshper/Sokoban-v0", {"preset": "simple", "board": "letters"}, states=8, probes=12)
    assert soko["counterfactual_pairs"] == 12 and abs(soko["counterfactual_shift"]) < 1e-3
    assert soko["counterfactual_ci_low"] <= 0 <= soko["counterfactual_ci_high"]


def test_illegal_mass_is_the_probability_of_moves_off_the_board() -> None:
    """A policy that always answers Up (Left) puts all its mass off the board exactly in the
    diagnostic states whose player is on the top row (left column)."""
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from learner.diagnostics import _random_states, policy_diagnostics
    from tests.conftest import with_logit_bias

    base = Policy.from_pretrained(build_tiny_model("text"))
    env = envs.make("freshper/FrozenLake-v0", feedback=False)
    _, _, _, legal = _random_states(env, 16, np.random.default_rng(0), False)
    for word in ("Up", "Left"):
        always = with_logit_bias(base, {t: 60.0 for t in base.encode_reply(f"<answer>{word}</answer>")})
        out = policy_diagnostics(always, "freshper/FrozenLake-v0", {"feedback": False}, states=16, probes=0)
        want = np.mean([word not in allow for allow in legal])
        assert 0 < want < 1 and out["illegal_mass"] == pytest.approx(want, abs=1e-3)
    # the reference: one distribution for all states, the mean of their uniform-over-legal ones
    names = ("Down", "Left", "Right", "Up")
    q = np.mean([[1 / len(allow) if a in allow else 0.0 for a in names] for allow in legal], axis=0)
    ref = np.mean([sum(q[i] for i, a in enumerate(names) if a not in allow) for allow in legal])
    assert out["blind_illegal_mass"] == pytest.approx(ref) and 0 < ref < 0.5


# -- lookahead reasoning -------------------------------------------------------------------------
def _neighbours(board: list[list[str]]) -> str:
    """The cells Left/Down/Right/Up of P, read off a parsed board ('-' off the board)."""
    (r, c), = [(i, j) for i, row in enumerate(board) for j, ch in enumerate(row) if ch == "P"]
    out = []
    for name, (dr, dc) in zip(("Left", "Down", "Right", "Up"), ((0, -1), (1, 0), (0, 1), (-1, 0))):
        i, j = r + dr, c + dc
        out.append(f" {name} {board[i][j] if 0 <= i < len(board) and 0 <= j < len(board[0]) else '-'}")
    return "".join(out)


def test_frozenlake_lookahead_names_the_cell_each_move_steps_on_and_keeps_the_answer() -> None:
    from envs.capabilities import think_reply

    env = envs.make("freshper/FrozenLake-v0")
    env.reset(seed=0, options={"desc": ["SFHF", "FHFF", "FFFF", "FFFG"], "position": [0, 1]})
    assert env.unwrapped.lookahead_text() == " Left S Down H Right H Up -"
    env.reset(seed=0, options={"desc": ["SFHF", "FHFF", "FFFF", "FFFG"], "position": [2, 3]})
    assert env.unwrapped.lookahead_text() == " Left F Down G Right - Up F"
    board = env.unwrapped.board_text()  # P at (2, 3)
    reply = think_reply(env.unwrapped.lookahead_text(), "<answer>Down</answer>")
    assert reply.startswith("<think>") and env.unwrapped.parse_action(reply) == (1, None)
    _, reward, terminated, _, info = env.step(reply)
    assert terminated and info["success"] and reward == 1.0
    right, wrong = think_reply(" Left F Down G Right - Up F", "<answer>Down</answer>"), \
        think_reply(" Left F Down F Right - Up F", "<answer>Down</answer>")
    diag = type(env.unwrapped).turn_diagnostics([(board, right), (board, wrong), (board, right), (board, "<answer>Up</answer>")])
    assert diag["lookahead_turns"] == 3 and diag["lookahead_exact"] == pytest.approx(2 / 3)
    assert "lookahead_exact" not in type(env.unwrapped).turn_diagnostics([(board, "<answer>Up</answer>")])
    search = envs.make("freshper/SearchQA-v0")  # a task without the Lookahead capability (envs.capabilities)
    search.reset(seed=0)
    from learner.pretrain import think_text

    with pytest.raises(NotImplementedError, match="--reasoning none"):  # what the learner says of tasks without one
        think_text(search.unwrapped, "lookahead")


def test_lookahead_format_examples_write_the_prompt_states_neighbours_before_a_random_answer() -> None:
    from envs.frozenlake import parse_board

    env = envs.make("freshper/FrozenLake-v0")
    streams = TransitionStreams("freshper/FrozenLake-v0", {"feedback": False}, n=16, seed=0, dynamics_fraction=0.5,
                                with_images=False, reasoning="lookahead")
    try:
        examples = [ex for _ in range(6) for ex in streams.examples()]
    finally:
        streams.close()
    formats = [ex for ex in examples if ex.kind == "format"]
    answers = set()
    assert len(formats) > 20
    for ex in formats:
        think, answer = ex.reply[len("<think>"):].split("</think>")
        assert think == _neighbours(parse_board(ex.text))
        assert env.unwrapped.parse_action(ex.reply)[1] is None
        answers.add(answer)
    assert len(answers) == 4  # the answer stays a random legal move
    assert all("<think>" not in ex.reply for ex in examples if ex.kind == "dynamics")


def test_state_format_examples_transcribe_the_shown_image_before_a_random_answer() -> None:
    """``reasoning="state"`` on the image task: each format reply's think tag is the board the
    example's image shows, in the text task's notation (the prompt itself shows no board)."""
    from envs.frozenlake import parse_board

    streams = TransitionStreams("freshper/FrozenLakeVision-v0", {"feedback": False}, n=16, seed=0,
                                dynamics_fraction=0.5, with_images=True, reasoning="state")
    try:
        examples = [ex for _ in range(6) for ex in streams.examples()]
    finally:
        streams.close()
    formats = [ex for ex in examples if ex.kind == "format"]
    assert len(formats) > 20 and all(len(ex.images) == 1 and parse_board(ex.text) is None for ex in formats)
    text_env = envs.make("freshper/FrozenLake-v0")
    answers = set()
    for ex in formats:
        think, answer = ex.reply[len("<think>"):].split("</think>")
        board = parse_board(think)
        assert board is not None and sum(row.count("P") for row in board) == 1
        # the image is the board's picture: the text task on that board renders the same pixels
        (r, c), = [(i, j) for i, row in enumerate(board) for j, ch in enumerate(row) if ch == "P"]
        desc = ["".join("S" if (i, j) == (0, 0) else ("F" if ch == "P" else ch) for j, ch in enumerate(row))
                for i, row in enumerate(board)]
        if board[0][0] != "P":
            desc[0] = "S" + desc[0][1:]
        text_env.reset(seed=0, options={"desc": desc, "position": [r, c]})
        np.testing.assert_array_equal(text_env.unwrapped.render_image(), ex.images[0])
        answers.add(answer)
    assert len(answers) == 4
    assert all("<think>" not in ex.reply for ex in examples if ex.kind == "dynamics")


def test_lookahead_changes_the_cache_key_and_none_keeps_the_old_one() -> None:
    from pathlib import Path

    from learner.pretrain import cache_key

    base = Path("tiny-text-s0-x")
    plain, look = PretrainSettings(), PretrainSettings(reasoning="lookahead")
    key = cache_key(base, "freshper/FrozenLake-v0", {}, plain, 0)
    assert key != cache_key(base, "freshper/FrozenLake-v0", {}, look, 0)
    assert cache_key(base, "freshper/FrozenLake-v0", {}, PretrainSettings(reasoning="state"), 0) not in (
        key, cache_key(base, "freshper/FrozenLake-v0", {}, look, 0))
    assert cache_key(base, "freshper/FrozenLake-v0", {}, PretrainSettings(reasoning="aim"), 0) not in (
        key, cache_key(base, "freshper/FrozenLake-v0", {}, look, 0))
    old = dataclasses.asdict(plain)
    del old["observe_fraction"], old["reasoning"]  # the recipe as it was before these fields
    del old["until_exact"], old["max_steps"], old["check_every"], old["follow_steps"], old["follow_fraction"]
    del old["success_fraction"], old["replies"]
    import hashlib
    import json

    from learner.pretrain import PRETRAIN_VERSION, random_play_digest
    blob = json.dumps([PRETRAIN_VERSION, base.name, "freshper/FrozenLake-v0", {}, old, 0,
                       random_play_digest("freshper/FrozenLake-v0", {})], sort_keys=True, default=str)
    assert key == hashlib.sha256(blob.encode()).hexdigest()[:12]
    with pytest.raises(ValueError, match="reasoning"):
        PretrainSettings(reasoning="chain")


def test_a_vision_task_drawn_differently_gets_another_cache_key(monkeypatch) -> None:
    """The pretrained model of an image task is keyed by its drawing too (a digest of its
    random play, images included): redrawing the task rebuilds the model; a text task's key
    does not depend on any drawing."""
    from pathlib import Path

    import envs.frozenlake as fl
    from learner.pretrain import cache_key

    base, cfg = Path("tiny-vision-s0-x"), PretrainSettings()
    vision = cache_key(base, "freshper/FrozenLakeVision-v0", {}, cfg, 0)
    text = cache_key(base, "freshper/FrozenLake-v0", {}, cfg, 0)
    assert vision == cache_key(base, "freshper/FrozenLakeVision-v0", {}, cfg, 0)
    tiles = {k: v.copy() for k, v in fl._tiles().items()}
    tiles["SP"][10:18, 10:18] = 0  # the player drawn another way
    monkeypatch.setattr(fl, "_tiles", lambda: tiles)
    assert cache_key(base, "freshper/FrozenLakeVision-v0", {}, cfg, 0) != vision
    assert cache_key(base, "freshper/FrozenLake-v0", {}, cfg, 0) == text


def test_random_replies_drawn_another_way_get_another_cache_key(monkeypatch) -> None:
    """What the pretraining sees includes the task's random replies: a task that draws them
    differently (here Sokoban drawing from every move again) is pretrained again."""
    from pathlib import Path

    from envs.base import MultiTurnEnv
    from envs.sokoban.env import SokobanEnv
    from learner.pretrain import cache_key

    base, cfg, kwargs = Path("tiny-text-s0-x"), PretrainSettings(), {"preset": "simple"}
    key = cache_key(base, "freshper/Sokoban-v0", kwargs, cfg, 0)
    assert key == cache_key(base, "freshper/Sokoban-v0", kwargs, cfg, 0)
    monkeypatch.setattr(SokobanEnv, "effective_actions", MultiTurnEnv.effective_actions)
    assert cache_key(base, "freshper/Sokoban-v0", kwargs, cfg, 0) != key


def test_diagnostics_with_lookahead_score_each_state_after_its_own_lookahead() -> None:
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from envs.capabilities import think_reply
    from learner.diagnostics import action_probabilities, policy_diagnostics

    policy = Policy.from_pretrained(build_tiny_model("text"))
    env = envs.make("freshper/FrozenLake-v0", feedback=False)
    states, ahead = [], []
    for seed in range(3):
        obs, _ = env.reset(seed=seed)
        states.append((obs["text"], []))
        ahead.append(env.unwrapped.lookahead_text())
    replies = [env.unwrapped.format_reply(a) for a in range(4)]
    together = action_probabilities(policy, states, replies, prefixes=ahead)
    for i, state in enumerate(states):  # the same as scoring each state's full replies alone
        alone = action_probabilities(policy, [state], [think_reply(ahead[i], r) for r in replies])
        np.testing.assert_allclose(together[i], alone[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(together, action_probabilities(policy, states, replies), atol=1e-4)
    out = policy_diagnostics(policy, "freshper/FrozenLake-v0", {"feedback": False}, states=8, probes=8,
                             reasoning="lookahead")
    assert set(out) == {"action_spread", "illegal_mass", "blind_illegal_mass", "counterfactual_shift", "counterfactual_pairs",
                        "counterfactual_ci_low", "counterfactual_ci_high"} and out["action_spread"] > 0
    assert out["counterfactual_ci_low"] <= out["counterfactual_shift"] <= out["counterfactual_ci_high"]


def test_a_task_with_text_of_its_own_gets_a_tokenizer_that_knows_its_names(tmp_path) -> None:
    from transformers import AutoTokenizer

    from agents.policies.tiny import TASK_VOCAB_SIZE, build_tiny_model, task_model

    shared = build_tiny_model("text", cache_dir=tmp_path)
    assert task_model("freshper/FrozenLake-v0", {"feedback": False}, cache_dir=tmp_path) == shared
    env = envs.make("freshper/SearchQA-v0")
    try:
        text = env.unwrapped.tokenizer_text()
        env.reset(seed=1)
        assert env.unwrapped.question.golden_answers[0] in text
    finally:
        env.close()
    from envs.capabilities import tokenizer_text

    assert tokenizer_text(envs.make("freshper/FrozenLake-v0").unwrapped) == ""  # no TaskVocabulary: the default
    own = task_model("freshper/SearchQA-v0", None, cache_dir=tmp_path)
    assert own != shared and task_model("freshper/SearchQA-v0", None, cache_dir=tmp_path) == own  # cached
    big, small = AutoTokenizer.from_pretrained(own), AutoTokenizer.from_pretrained(shared)
    assert len(big) > TASK_VOCAB_SIZE > len(small)
    names = [line for line in text.split("\n")[::2][:100]]  # passage titles: made-up names
    per_name = [(len(big(f" {n}")["input_ids"]), len(small(f" {n}")["input_ids"])) for n in names]
    assert np.mean([b for b, _ in per_name]) < 0.4 * np.mean([s for _, s in per_name])
    for tag in ("<search>", "<answer>", "</answer>"):  # the reply tags stay single tokens
        assert len(big(tag)["input_ids"]) == 1


def test_the_follow_stage_builds_on_the_cached_first_stage(tmp_path) -> None:
    """``follow_steps``: the first stage is cached as a model of its own (the key of a recipe
    without a follow stage is unchanged), the second starts from it, and the report sums them."""
    kwargs = {"preset": "simple", "feedback": False, "board": "letters"}
    first_cfg = PretrainSettings(steps=3, batch=8, reasoning="subgoal")
    cfg = dataclasses.replace(first_cfg, follow_steps=2, follow_fraction=1.0)
    path, report = pretrained_default("freshper/Sokoban-v0", kwargs, cfg, seed=0, cache_dir=tmp_path)
    first, first_report = pretrained_default("freshper/Sokoban-v0", kwargs, first_cfg, seed=0, cache_dir=tmp_path)
    assert first_report["cached"] and first != path  # built on the way, found again
    assert report["pretrain_steps"] == 5 and report["pretrain_follow_steps"] == 2
    assert report["pretrain_episodes"] > first_report["pretrain_episodes"]
    import json

    assert json.loads((path / "freshper_pretrain.json").read_text())["base_model"] == first.name
    again, report2 = pretrained_default("freshper/Sokoban-v0", kwargs, cfg, seed=0, cache_dir=tmp_path)
    assert again == path and report2["cached"]
    with pytest.raises(ValueError, match="subgoal"):
        PretrainSettings(reasoning="lookahead", follow_steps=2)


def test_success_examples_are_whole_random_episodes_that_the_task_scored_a_success() -> None:
    """SearchQA: each imitated episode ends with an answer the task scores correct, its turns
    come in order (a search first), and the episodes random play took to find them are counted."""
    import re

    from envs.search.metrics import exact_match

    streams = TransitionStreams("freshper/SearchQA-v0", None, 4, 0, 0.5, False, success_fraction=1.0)
    try:
        examples = [ex for _ in range(12) for ex in streams.examples()]
        found, episodes = streams.successes_found, streams._episodes
    finally:
        streams.close()
    kinds = {k: sum(ex.kind == k for ex in examples) for k in ("dynamics", "format", "success")}
    assert kinds["format"] == 0 and kinds["success"] > 10 and kinds["dynamics"] > 10
    success = [ex for ex in examples if ex.kind == "success"]
    assert success[0].reply.startswith("<search>")  # the first turn of a random episode
    answers = [ex for ex in success if ex.reply.startswith("<answer>")]
    assert len(answers) >= found - 1 >= 2  # one answer per finished episode (the last may be cut)
    env = envs.make("freshper/SearchQA-v0")
    golds_of = {q.question: q.golden_answers for q in env.unwrapped.questions}
    env.close()
    for ex in answers:  # the answer is right for the question of its own prompt, by the task's own scoring
        golds = golds_of[re.findall(r"Question: (.*)\n", ex.text)[-1]]
        assert exact_match(re.fullmatch(r"<answer>(.*)</answer>", ex.reply).group(1), golds) == 1.0
    assert episodes > 4 * found  # random play mostly fails: the search for successes is counted


def test_success_examples_refuse_a_task_random_play_never_solves(monkeypatch) -> None:
    monkeypatch.setattr(TransitionStreams, "MAX_SCOUT_EPISODES", 50)
    streams = TransitionStreams("freshper/FrozenLake-v0", {"desc": ["SH", "HG"]}, 1, 0, 0.0, False,
                                success_fraction=1.0)
    try:
        with pytest.raises(RuntimeError, match="50 random episodes .* without a success"):
            streams.examples()
    finally:
        streams.close()


def test_the_success_share_is_part_of_the_cache_key_and_checked() -> None:
    from pathlib import Path

    from learner.pretrain import cache_key

    base = Path("tiny-text-s0-x")
    assert cache_key(base, "freshper/SearchQA-v0", {}, PretrainSettings(), 0) != cache_key(
        base, "freshper/SearchQA-v0", {}, PretrainSettings(success_fraction=0.5), 0)
    with pytest.raises(ValueError, match="success_fraction"):
        PretrainSettings(success_fraction=1.5)
