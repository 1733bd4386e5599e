"""``python -m agents.play <id> --model [PATH]``: watch a model play a task, and take over.

The terminal loop of ``python -m envs.play`` with :class:`agents.interactive.ModelPlayer`
proposing each reply: Enter accepts it, typing a reply takes over for that turn (the model
then goes on from the new state). ``--model`` without a path is the embedded tiny model;
``--auto`` lets the model play the whole episode without input.
"""

from __future__ import annotations

import sys
from typing import Sequence

from envs.cli import ArgumentParser, import_tasks
from envs.play import add_play_arguments, run_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m agents.play", description=__doc__.split("\n\n")[0])
    add_play_arguments(parser)
    parser.add_argument("--model", nargs="?", const="", default="", metavar="PATH",
                        help="model folder (HF layout, e.g. runs/<run>/checkpoints/iter_N/model); none: the embedded model")
    parser.add_argument("--auto", action="store_true", help="send every model reply without waiting for Enter")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sample", action="store_true", help="sample replies (default: greedy)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the model's reply length limit, in tokens")
    parser.add_argument("--device", default="cpu", help="torch device of the model: cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", help="auto|bf16|fp16|fp32 (auto: bf16 on a GPU; on the CPU bf16 for a model of 50M+ parameters where the CPU has bf16 units, else fp32)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    try:
        import_tasks(args.imports)  # before the player: it reads the task's modality
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from agents.interactive import ModelPlayer
    from agents.runfolder import model_folder_problem

    model = args.model or None
    if model:  # a checkpoint is checked against its manifest, as the viewer checks it
        folder, problem = model_folder_problem(model)
        if problem:
            print(f"error: cannot play {model}: {problem}", file=sys.stderr)
            return 2
        model = str(folder) if folder.is_dir() else model
    try:
        # Loading never runs a model folder's own code nor asks about it on stdin (the moves' channel).
        player = ModelPlayer(model, args.env_id, greedy=not args.sample, temperature=args.temperature,
                             max_new_tokens=args.max_new_tokens, device=args.device, dtype=args.dtype)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if type(exc).__name__ not in ("SafetensorError", "UnpicklingError"):
            raise
        print(f"error: the model at {model} cannot be loaded: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        return 2
    return run_cli(args, player=player, auto=args.auto)


if __name__ == "__main__":
    sys.exit(main())
