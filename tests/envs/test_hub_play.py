"""The human play CLI, driven in-process with scripted input."""

from __future__ import annotations

import io
import pytest
from PIL import Image

from envs.frozenlake import MAPS
from envs.play import main, parse_kwargs, play, wrap_reply

LAKE = {"desc": MAPS["4x4"]}  # SFFF / FHFH / FFFH / HFFG
WINNING = ["right", "r", "<answer>Down</answer>", "down", "jump!", "down", "RIGHT"]


def _play(lines: list[str], env_id: str = "freshper/FrozenLake-v0", **kw):
    out = io.StringIO()
    summary = play(env_id, seed=0, kwargs=kw.pop("kwargs", LAKE), stdin=io.StringIO("".join(l + "\n" for l in lines)),
                   stdout=out, **kw)
    return summary, out.getvalue()


def test_scripted_episode_reaches_goal_and_summarises(tmp_path) -> None:
    gif = tmp_path / "episode.gif"
    summary, text = _play(WINNING, save_gif=str(gif))
    assert (summary.turns, summary.success, summary.invalid_replies, summary.quit_early) == (7, True, 1, False)
    assert summary.episode_return == pytest.approx(0.9)
    assert "P F F F" in text and "You reached the goal!" in text and "(invalid reply)" in text
    assert "Summary: 7 turns, return +0.90, success True, invalid replies 1" in text
    assert summary.frames == 8
    with Image.open(gif) as img:
        assert img.size == (112, 112) and img.n_frames >= 6


def test_quit_and_end_of_input_stop_the_episode() -> None:
    summary, text = _play(["down", "q"])
    assert (summary.turns, summary.quit_early, summary.success) == (1, True, False)
    assert _play([])[0].quit_early


def test_vision_task_shows_the_text_rendering_of_the_image() -> None:
    _, text = _play(["down", "q"], env_id="freshper/FrozenLakeVision-v0")
    assert "the model sees a picture of" in text and "P F F F" in text


def test_a_player_proposes_and_enter_accepts() -> None:
    calls: list = []

    class ScriptedPlayer:
        def reset(self, obs, info):
            calls.append(("reset", info["turn"]))

        def act(self, obs, state_text=None):
            return "<answer>Right</answer>"

    # Enter accepts Right twice, then the user takes over with Down x3, then Enter: Right -> goal.
    summary, text = _play(["", "", "down", "down", "down", ""], player=ScriptedPlayer())
    assert calls[:1] == [("reset", 0)]
    assert summary.success and summary.turns == 6
    assert "model> <answer>Right</answer>" in text


def test_the_random_agent_plays_to_the_end_without_input() -> None:
    out = io.StringIO()
    summary = play("freshper/Sokoban-v0", seed=3, random_agent=True, auto=True, stdin=io.StringIO(""), stdout=out)
    assert not summary.quit_early and summary.invalid_replies == 0
    assert summary.turns == 10 or summary.success  # simple preset: 10 turns unless solved
    assert out.getvalue().count("player> <answer>") == summary.turns
    assert main(["freshper/FrozenLake-v0", "--random", "--seed", "1"]) == 0


def test_auto_play_without_a_player_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="auto play needs a player"):
        _play([], auto=True)


def test_cli_main_exit_codes(capsys) -> None:
    assert main(["freshper/FrozenLak-v0"]) == 2
    assert "Did you mean 'freshper/FrozenLake-v0'" in capsys.readouterr().err
    assert main(["freshper/FrozenLake-v0", "--kw", "size"]) == 2


def test_reply_wrapping_and_kwargs_parsing() -> None:
    assert wrap_reply(" up\n") == "<answer>up</answer>"
    assert wrap_reply("<search>who</search>") == "<search>who</search>"
    assert parse_kwargs(["size=8", "is_slippery=true", "preset=hard", "desc=['SF','FG']"]) == {
        "size": 8, "is_slippery": True, "preset": "hard", "desc": ["SF", "FG"]}


import envs  # noqa: E402

_ALL = [pytest.param(s.id, id=s.id, marks=pytest.mark.skipif(not s.available, reason=s.missing_message()))
        for s in envs.registered_tasks() if not s.needs]  # tasks needing a url etc.: their own tests


@pytest.mark.usefixtures("search_cache")
@pytest.mark.parametrize("env_id", _ALL)
def test_every_task_plays_its_random_agent_to_the_end(env_id: str) -> None:
    out = io.StringIO()
    summary = play(env_id, seed=0, random_agent=True, auto=True, stdin=io.StringIO(""), stdout=out)
    assert not summary.quit_early and summary.invalid_replies == 0 and summary.turns >= 1
    assert out.getvalue().count("player> ") == summary.turns and "Summary:" in out.getvalue()
    assert main([env_id, "--random", "--seed", "1"]) == 0  # the command line: python -m envs.play ID --random
