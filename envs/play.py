"""``python -m envs.play <id>``: play a registered task in the terminal.

Each turn shows the observation (for vision tasks, the text rendering of the picture the
model sees), reads a reply and prints the reward. A reply without any ``<`` is wrapped into
``<answer>...</answer>`` for convenience (``up`` -> ``<answer>up</answer>``); a reply with
tags (``<search>...</search>``) is sent as typed. ``q`` or end of input quits.

``--random`` plays the task's random agent (its random well-formed replies, the env contract's
``sample_reply``) to the end without input: the quickest check of a new task. ``play`` takes
any *player* (``reset(obs, info)``, ``act(obs, state_text) -> reply``) that proposes each
reply; Enter accepts a proposal, typing a reply takes over for that turn. A model player lives
in ``agents`` (``python -m agents.play <id> --model PATH``), so ``envs`` never imports torch.
``--save-gif PATH`` writes the episode's frames with Pillow.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, TextIO

import numpy as np

import envs
from envs.base import IMAGE_PLACEHOLDER
from envs.cli import ArgumentParser, add_import_flag, import_tasks

QUIT = {"q", "quit", "exit"}


@dataclass
class PlaySummary:
    """What happened in one played episode."""

    turns: int
    episode_return: float
    success: bool
    invalid_replies: int
    quit_early: bool
    frames: int


def wrap_reply(line: str) -> str:
    """A bare action becomes ``<answer>action</answer>``; a line with tags is kept as typed."""
    line = line.strip()
    return line if "<" in line else f"<answer>{line}</answer>"


def parse_kwargs(pairs: Sequence[str]) -> dict[str, Any]:
    """``["size=8", "is_slippery=true", "preset=hard"]`` -> kwargs (JSON/Python literals, else str)."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--kw expects key=value, got {pair!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
        kwargs[key.strip()] = value
    return kwargs


def _frame(env: Any) -> np.ndarray | None:
    try:
        return np.asarray(env.unwrapped.render_image(), dtype=np.uint8)
    except NotImplementedError:
        return None


def _show(env: Any, obs: dict, out: TextIO) -> None:
    text = obs["text"]
    if "image" in obs:
        board = env.unwrapped.render_text()
        if board and board != IMAGE_PLACEHOLDER:
            text = text.replace(IMAGE_PLACEHOLDER, f"[image {obs['image'].shape[1]}x{obs['image'].shape[0]}; "
                                                  f"the model sees a picture of:]\n{board}")
    out.write(f"\n{text}\n")


class Player(Protocol):
    """Proposes a reply each turn (a model, a script, the random agent)."""

    def reset(self, obs: dict, info: dict) -> None:
        """A new episode starts with this observation."""

    def act(self, obs: dict, state_text: str | None = None) -> str:
        """The proposed reply to the current observation (``state_text``: the env's state)."""


class RandomPlayer:
    """The task's random agent: a random well-formed reply each turn (``env.sample_reply``)."""

    def __init__(self, env: Any, seed: int | None = None) -> None:
        self.env = env
        self.rng = np.random.default_rng(seed)

    def reset(self, obs: dict, info: dict) -> None:
        pass

    def act(self, obs: dict, state_text: str | None = None) -> str:
        return self.env.unwrapped.sample_reply(self.rng)


def play(
    env_id: str,
    *,
    seed: int | None = None,
    kwargs: dict[str, Any] | None = None,
    save_gif: str | None = None,
    player: Player | None = None,
    random_agent: bool = False,
    auto: bool = False,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> PlaySummary:
    """Play one episode of ``env_id`` reading replies from ``stdin``; return its summary.

    ``player`` proposes each reply (``random_agent``: the task's random agent); an empty
    input line accepts a proposal, any other line replaces it. ``auto`` sends every proposal
    without reading input (the random agent's default on the command line). ``stdin`` and
    ``stdout`` default to the process's streams at the time of the call.
    """
    stdin = sys.stdin if stdin is None else stdin
    env = envs.make(env_id, **(kwargs or {}))
    if random_agent:
        player = RandomPlayer(env, seed)
    if auto and player is None:
        raise ValueError("auto play needs a player (--random, or a model through python -m agents.play)")
    obs, info = env.reset(seed=seed)
    if player is not None:
        player.reset(obs, info)
    frames = [f for f in [_frame(env)] if f is not None] if save_gif else []
    out = sys.stdout if stdout is None else stdout
    out.write(f"Playing {env_id} (seed {seed}). A bare reply like 'up' is sent as <answer>up</answer>; "
              "'q' quits.\n")
    _show(env, obs, out)
    turns, invalid, ret, success, quit_early, done = 0, 0, 0.0, False, False, False
    while not done:
        proposal = player.act(obs, env.unwrapped.state_text()) if player is not None else None
        if auto:
            out.write(f"player> {proposal}\n")
            line = "\n"
        else:
            if proposal is not None:
                out.write(f"model> {proposal}\n[Enter] accept, or type your own reply: ")
            else:
                out.write("your reply> ")
            out.flush()
            line = stdin.readline()
            if not stdin.isatty():  # scripted input: echo it so the transcript reads like a session
                out.write(line if line.endswith("\n") else line + "\n")
        if not line or line.strip().lower() in QUIT:
            quit_early = True
            out.write("\n(quit)\n")
            break
        reply = proposal if (proposal is not None and not line.strip()) else wrap_reply(line)
        obs, reward, terminated, truncated, info = env.step(reply)
        turns += 1
        ret += float(reward)
        invalid += 0 if info.get("action_is_valid", True) else 1
        success = bool(info.get("success", False))
        done = terminated or truncated
        if save_gif:
            frame = _frame(env)
            if frame is not None:
                frames.append(frame)
        _show(env, obs, out)
        flag = "" if info.get("action_is_valid", True) else " (invalid reply)"
        out.write(f"reward {reward:+.2f}{flag}, return {ret:+.2f}\n")
    if save_gif:
        if frames:
            from PIL import Image

            images = [Image.fromarray(f) for f in frames]
            images[0].save(save_gif, save_all=True, append_images=images[1:], duration=600, loop=0)
            out.write(f"saved {len(frames)} frames to {save_gif}\n")
        else:
            out.write(f"{env_id} has no image rendering; no GIF written\n")
    env.close()
    summary = PlaySummary(turns, ret, success, invalid, quit_early, len(frames))
    out.write(f"\nSummary: {turns} turns, return {ret:+.2f}, success {success}, invalid replies {invalid}"
              f"{' (quit early)' if quit_early else ''}\n")
    return summary


def add_play_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments ``python -m envs.play`` and ``python -m agents.play`` share."""
    parser.add_argument("env_id", help="a registered task id (see `python -m envs list`)")
    parser.add_argument("--seed", type=int, default=None, help="reset seed (default: random)")
    parser.add_argument("--save-gif", metavar="PATH", default=None, help="write the episode's frames as a GIF")
    parser.add_argument("--kw", nargs="*", default=[], metavar="KEY=VALUE", help="task keyword arguments, e.g. size=8")
    add_import_flag(parser)


def run_cli(args: argparse.Namespace, **play_kwargs: Any) -> int:
    """Play with parsed arguments; turn the usual failures into ``error:`` lines and exit codes."""
    try:
        import_tasks(args.imports)
        play(args.env_id, seed=args.seed, kwargs=parse_kwargs(args.kw), save_gif=args.save_gif, **play_kwargs)
    except (KeyError, ValueError, RuntimeError, ImportError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed
        return 141
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m envs.play", description=__doc__.split("\n\n")[0])
    add_play_arguments(parser)
    parser.add_argument("--random", action="store_true",
                        help="play the task's random agent to the end (random well-formed replies, no input)")
    parser.add_argument("--step", action="store_true", help="with --random: Enter accepts each reply, typing takes over")
    args = parser.parse_args(argv)
    return run_cli(args, random_agent=args.random, auto=args.random and not args.step)


if __name__ == "__main__":
    sys.exit(main())
