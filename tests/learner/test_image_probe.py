"""experiments/vision/image_probe.py: the safe-move probe of an image task, from its evaluation records."""

from __future__ import annotations

import random

import pytest
import yaml

import envs
from agents.record import Trajectory, Turn, save_records


def _play(env_id: str, seeds, rng: random.Random):
    """Episodes of random moves on ``env_id`` as records, and their (text observation, reply) turns."""
    env = envs.make(env_id, feedback=False)
    records, turns = [], []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        rec_turns, total, done = [], 0.0, False
        while not done:
            reply = f"<answer>{rng.choice(['Left', 'Down', 'Right', 'Up'])}</answer>"
            text = obs["text"] if isinstance(obs, dict) else obs
            rec_turns.append(Turn(observation=text, reply=reply, reward=0.0, action_is_valid=True))
            turns.append((text, reply))
            obs, reward, terminated, truncated, _ = env.step(reply)
            total += float(reward)
            done = terminated or truncated
        records.append(Trajectory(env_id=env_id, seed=seed, group_id=0, turns=rec_turns, samples=[],
                                  episode_return=total, success=total > 0, policy_version=0))
    return records, turns


def _run_folder(root, name, env_id, records):
    run = root / name
    (run / "eval").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"env_id": env_id, "env_kwargs": {"feedback": False}}))
    save_records(records, run / "eval" / "final")
    return run


def test_the_image_probe_equals_the_text_probe_of_the_same_episodes(tmp_path, capsys) -> None:
    from experiments.vision import image_probe

    seeds = range(1_900_000_000, 1_900_000_060)
    vision_records, _ = _play("freshper/FrozenLakeVision-v0", seeds, random.Random(3))
    text_records, text_turns = _play("freshper/FrozenLake-v0", seeds, random.Random(3))
    assert all("P" not in t.observation.split("<image>")[-1] for r in vision_records for t in r.turns)
    want = envs.task_class("freshper/FrozenLake-v0").turn_diagnostics(text_turns)
    assert want["probe_down_right"] > 20
    vision_run = _run_folder(tmp_path, "vision", "freshper/FrozenLakeVision-v0", vision_records)
    text_run = _run_folder(tmp_path, "text", "freshper/FrozenLake-v0", text_records)
    assert image_probe.main([str(vision_run), str(text_run)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()[1:]]
    for row in rows:
        assert int(row[3]) == want["probe_down_right"]
        assert float(row[4]) == pytest.approx(want["probe_safe_rate"], abs=0.005)


def test_a_record_the_text_task_does_not_reproduce_is_refused(tmp_path) -> None:
    from experiments.vision import image_probe

    records, _ = _play("freshper/FrozenLakeVision-v0", range(5), random.Random(0))
    records[2].episode_return += 1.0
    run = _run_folder(tmp_path, "vision", "freshper/FrozenLakeVision-v0", records)
    with pytest.raises(SystemExit, match="not the task these records come from"):
        image_probe.main([str(run)])


def test_transcriptions_are_scored_against_the_rebuilt_boards(tmp_path, capsys) -> None:
    """``--reasoning state`` replies write the board before the answer; the probe's last column
    is how often that think tag is the turn's board exactly, read off the replayed text task."""
    from experiments.vision import image_probe
    from envs.capabilities import think_reply

    env = envs.make("freshper/FrozenLakeVision-v0", feedback=False)
    rng, records, right, total_turns = random.Random(5), [], 0, 0
    for seed in range(1_900_000_100, 1_900_000_130):
        obs, _ = env.reset(seed=seed)
        rec_turns, total, done = [], 0.0, False
        while not done:
            board = env.unwrapped.render_text()
            exact = rng.random() < 0.6
            right += exact
            total_turns += 1
            shown = board if exact else board.replace("F", "H", 1)
            reply = think_reply(shown, f"<answer>{rng.choice(['Left', 'Down', 'Right', 'Up'])}</answer>")
            rec_turns.append(Turn(observation=obs["text"], reply=reply, reward=0.0, action_is_valid=True))
            obs, reward, terminated, truncated, _ = env.step(reply)
            total += float(reward)
            done = terminated or truncated
        records.append(Trajectory(env_id="freshper/FrozenLakeVision-v0", seed=seed, group_id=0, turns=rec_turns,
                                  samples=[], episode_return=total, success=total > 0, policy_version=0))
    assert 0 < right < total_turns
    run = _run_folder(tmp_path, "state", "freshper/FrozenLakeVision-v0", records)
    assert image_probe.main([str(run)]) == 0
    row = capsys.readouterr().out.strip().splitlines()[1].split()
    assert float(row[-2]) == pytest.approx(right / total_turns, abs=0.005)
    assert float(row[-1]) == 1.0  # the wrong transcriptions changed a cell, not the player
    assert image_probe.transcribed_exactly([("x", "<answer>Up</answer>")]) == (0, 0, 0)
    moved = think_reply(" F P F F\n F F F F\n F F F F\n F F F G", "<answer>Up</answer>")
    assert image_probe.transcribed_exactly([(" P F F F\n F F F F\n F F F F\n F F F G", moved)]) == (1, 0, 0)


def test_evaluations_of_an_image_task_report_the_probe_of_the_replayed_boards() -> None:
    """``train.py``'s evaluations call ``task_turn_diagnostics``: for an image task it rebuilds
    the boards by replaying each record, so the run's summary has the same probe as the text
    task's on the same episodes; a record the task does not reproduce leaves no probe."""
    from learner.report import task_turn_diagnostics

    seeds = range(1_900_000_000, 1_900_000_060)
    vision_records, _ = _play("freshper/FrozenLakeVision-v0", seeds, random.Random(3))
    _, text_turns = _play("freshper/FrozenLake-v0", seeds, random.Random(3))
    want = envs.task_class("freshper/FrozenLake-v0").turn_diagnostics(text_turns)
    got = task_turn_diagnostics("freshper/FrozenLakeVision-v0", vision_records, {"feedback": False})
    assert want["probe_down_right"] > 20
    assert got == pytest.approx(want, nan_ok=True)
    vision_records[4].episode_return += 1.0
    assert task_turn_diagnostics("freshper/FrozenLakeVision-v0", vision_records, {"feedback": False}) == {}
