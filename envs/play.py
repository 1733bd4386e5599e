"""``python -m envs.play <id>``: play a registered task in the terminal.

Each turn shows the observation (for vision tasks, the text rendering of the picture the
model sees), reads a reply and prints the reward. A reply without any ``<`` is wrapped into
``<answer>...</answer>`` for convenience (``up`` -> ``<answer>up</answer>``); a reply with
tags (``<search>...</search>``) is sent as typed. ``q`` or end of input quits.

``--model [PATH]`` lets a model play (``agents.interactive.ModelPlayer``, imported only then,
so ``envs`` never imports torch): each turn shows its reply; Enter accepts it, typing a reply
instead takes over for that turn. ``--save-gif PATH`` writes the episode's frames with Pillow.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from typing import Any, Sequence, TextIO

import numpy as np

import envs
from envs.base import IMAGE_PLACEHOLDER

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


def _load_player(model: str | None, env_id: str) -> Any:
    try:
        from agents.interactive import ModelPlayer  # lazy: pulls in torch
    except ImportError as exc:
        raise RuntimeError(
            f"--model needs agents.interactive.ModelPlayer, which could not be imported ({exc}). "
            "It is provided by the agents package; play without --model meanwhile."
        ) from exc
    return ModelPlayer(model, env_id)


def play(
    env_id: str,
    *,
    seed: int | None = None,
    kwargs: dict[str, Any] | None = None,
    save_gif: str | None = None,
    model: str | None = None,
    use_model: bool = False,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> PlaySummary:
    """Play one episode of ``env_id`` reading replies from ``stdin``; return its summary.

    With ``use_model`` a ``ModelPlayer(model, env_id)`` proposes each reply (``model`` None is
    the embedded default); an empty input line accepts it, any other line replaces it.
    """
    env = envs.make(env_id, **(kwargs or {}))
    player = _load_player(model, env_id) if use_model else None
    obs, info = env.reset(seed=seed)
    if player is not None:
        player.reset(obs, info)
    frames = [f for f in [_frame(env)] if f is not None] if save_gif else []
    out = stdout
    out.write(f"Playing {env_id} (seed {seed}). A bare reply like 'up' is sent as <answer>up</answer>; "
              "'q' quits.\n")
    _show(env, obs, out)
    turns, invalid, ret, success, quit_early, done = 0, 0, 0.0, False, False, False
    while not done:
        proposal = player.act(obs, env.unwrapped.state_text()) if player is not None else None
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envs.play", description=__doc__.split("\n\n")[0])
    parser.add_argument("env_id", help="a registered task id (see `python -m envs list`)")
    parser.add_argument("--seed", type=int, default=None, help="reset seed (default: random)")
    parser.add_argument("--save-gif", metavar="PATH", default=None, help="write the episode's frames as a GIF")
    parser.add_argument("--kw", nargs="*", default=[], metavar="KEY=VALUE", help="task keyword arguments, e.g. size=8")
    parser.add_argument("--model", nargs="?", const="", default=None, metavar="PATH",
                        help="let a model play (Enter accepts its reply); no PATH = the embedded default model")
    args = parser.parse_args(argv)
    try:
        play(args.env_id, seed=args.seed, kwargs=parse_kwargs(args.kw), save_gif=args.save_gif,
             model=args.model or None, use_model=args.model is not None)
    except (KeyError, ValueError, RuntimeError, ImportError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
