"""Held-out evaluation of a policy on one task, and its CLI.

    python -m agents.evaluate --env freshper/FrozenLake-v0 [--model PATH] [--episodes 100]
        [--seed 1900000000] [--greedy] [--context window:0] [--kw KEY=VALUE ...] [--save DIR]
    python -m agents.evaluate --env ID --base-url URL --model NAME [--api-key-env VAR] ...   # agents/rollout/openai_eval.py

Seed convention: held-out tasks use seeds from ``agents.rollout.seeds.EVAL_SEED_BASE`` (1.9e9) on; ``train.py``
draws training and warm-up seeds below it and evaluates from it too, so this CLI's default
maps are the ones a run's evaluations used and were never trained on. Each evaluation
episode is its own task seed (group size 1). Success is reported with a 95% Wilson interval,
the mean return with a normal-approximation 95% interval. Task keyword arguments default to
``train.py``'s (``agents.rollout.runner.default_env_kwargs``): a board task in ``window:0`` context is
observed as the board alone, as in training.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agents.policies.policy import Policy, configure_threads
from agents.record import Trajectory, episode_stats, save_records
from agents.rollout.runner import Runner
from agents.rollout.seeds import EVAL_SEED_BASE

logger = logging.getLogger(__name__)

#: train.py's reply cap (learner.config's ``rollout.max_new_tokens``): the CLIs' default, so an
#: evaluation plays as training did.
TRAIN_MAX_NEW_TOKENS = 8
MAX_NEW_TOKENS_HELP = ("reply cap in tokens (default: the run's, for a model folder inside a train.py run; else "
                       f"train.py's default, {TRAIN_MAX_NEW_TOKENS})")


def run_max_new_tokens(model: str | None) -> int:
    """The ``max_new_tokens`` of the train.py run whose checkpoint ``model`` is (its ``config.yaml``
    a few folders up: ``<run>/checkpoints/iter_N/model``), else :data:`TRAIN_MAX_NEW_TOKENS`."""
    if model:
        from agents.safeio import load_yaml

        folder = Path(model)
        for parent in [folder, *folder.parents][:4]:
            path = parent / "config.yaml"
            if path.is_file():
                try:
                    value = (load_yaml(path.read_text(encoding="utf-8"), what=str(path)) or {}).get("max_new_tokens")
                except Exception:  # not a run's config: the default
                    break
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
                break
    return TRAIN_MAX_NEW_TOKENS


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (sane at 0% and 100%). It always
    holds the observed share: at 0% and 100% one of its ends is exactly that share (rounding
    would otherwise leave it a hair inside, e.g. 200 of 200 -> 0.9999999999999999)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))


def mean_interval(values: list[float], z: float = 1.959964) -> tuple[float, float]:
    """Normal-approximation 95% interval of the mean."""
    if not values:
        return (0.0, 0.0)
    arr = np.asarray(values, dtype=np.float64)
    half = z * arr.std(ddof=1) / math.sqrt(len(arr)) if len(arr) > 1 else 0.0
    return (float(arr.mean() - half), float(arr.mean() + half))


@dataclass
class EvalResult:
    """Summary of an evaluation run plus its records."""

    env_id: str
    episodes: int
    success_rate: float
    success_ci: tuple[float, float]
    mean_return: float
    return_ci: tuple[float, float]
    invalid_reply_rate: float
    mean_turns: float
    records: list[Trajectory] = field(default_factory=list, repr=False)
    stats: dict[str, Any] = field(default_factory=dict, repr=False)

    def table(self) -> str:
        """A small plain-text table for the CLI."""
        rows = [
            ("task", self.env_id),
            ("episodes", str(self.episodes)),
            ("success", f"{self.success_rate:.3f}  [{self.success_ci[0]:.3f}, {self.success_ci[1]:.3f}]"),
            ("mean return", f"{self.mean_return:.3f}  [{self.return_ci[0]:.3f}, {self.return_ci[1]:.3f}]"),
            ("invalid replies", f"{self.invalid_reply_rate:.3f}"),
            ("mean turns", f"{self.mean_turns:.2f}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def evaluate(
    policy: Policy,
    env_id: str,
    *,
    episodes: int = 100,
    seed: int = EVAL_SEED_BASE,
    greedy: bool = False,
    env_kwargs: dict[str, Any] | None = None,
    context: str = "window:0",
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    max_context_tokens: int = 2048,
    batch_size: int = 64,
    progress: bool = False,
    runner: Runner | None = None,
) -> EvalResult:
    """Play ``episodes`` episodes on seeds ``seed, seed+1, ...`` and summarise them.

    ``runner`` (group size 1) plays them instead of a new one (a trainer keeps one for all its
    evaluations); the task and rollout arguments are then the runner's. Failed episodes (an
    infrastructure fault) are reported in ``stats["failed"]`` and left out of the rates.
    """
    own = runner is None
    if runner is None:
        runner = Runner(policy, env_id, env_kwargs=env_kwargs, group_size=1, context=context,
                        max_new_tokens=max_new_tokens, temperature=temperature,
                        max_context_tokens=max_context_tokens, seed=seed)
    records: list[Trajectory] = []
    seeds = list(range(seed, seed + episodes))
    try:
        for start in range(0, len(seeds), batch_size):
            recs, _ = runner.collect(seeds[start:start + batch_size], policy_version=-1, greedy=greedy,
                                     progress=progress, rng_seed=seed + start)
            records += recs
    finally:
        if own:
            runner.close()
    stats = episode_stats(records)
    good = [r for r in records if not r.failed]
    wins = sum(r.success for r in good)
    return EvalResult(
        env_id=runner.env_id, episodes=len(good), success_rate=stats["success_rate"],
        success_ci=wilson_interval(wins, len(good)), mean_return=stats["mean_return"],
        return_ci=mean_interval([r.episode_return for r in good]), invalid_reply_rate=stats["invalid_reply_rate"],
        mean_turns=stats["mean_turns"], records=records, stats=stats,
    )


def save_gifs(records: list[Trajectory], folder: Path, limit: int = 4, fps: int = 2) -> list[Path]:
    """One GIF per record (the observed frames, final frame included) for image tasks."""
    from PIL import Image

    out = []
    folder.mkdir(parents=True, exist_ok=True)
    for n, rec in enumerate(r for r in records if r.images):
        if n >= limit:
            break
        frames = [Image.fromarray(im) for im in rec.images]
        path = folder / f"episode_{n}_seed{rec.seed}.gif"
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
        out.append(path)
    return out


def endpoint_main(argv: list[str]) -> int:
    """``--base-url``: the model behind an OpenAI-compatible endpoint plays (agents/rollout/openai_eval.py)."""
    import json

    from agents.rollout.openai_eval import EndpointError, EndpointRunner, add_arguments, endpoint_from_args, endpoint_summary
    from agents.rollout.runner import default_env_kwargs
    from envs.cli import ArgumentParser, add_import_flag
    from envs.play import parse_kwargs

    parser = ArgumentParser(prog="python -m agents.evaluate --base-url URL",
                            description="Evaluate a model behind an OpenAI-compatible chat-completions endpoint.")
    parser.add_argument("--env", required=True, help="task id, e.g. freshper/FrozenLake-v0")
    add_import_flag(parser)
    parser.add_argument("--model", required=True, help="the model name the endpoint serves")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=EVAL_SEED_BASE, help="first task seed")
    parser.add_argument("--greedy", action="store_true", help="temperature 0")
    parser.add_argument("--context", default="window:0", help="'window:k' or 'full'")
    parser.add_argument("--kw", nargs="*", default=None, metavar="KEY=VALUE",
                        help="task keyword arguments (default: train.py's defaults for the task and context)")
    parser.add_argument("--max-new-tokens", type=int, default=TRAIN_MAX_NEW_TOKENS,
                        help=f"max_tokens of each request (default: train.py's, {TRAIN_MAX_NEW_TOKENS})")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--save", default=None, help="folder for records.jsonl (+ GIFs for image tasks)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    endpoint = endpoint_from_args(parser, args)
    error = _known_task(args.env, args.imports)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    env_kwargs = parse_kwargs(args.kw) if args.kw is not None else default_env_kwargs(args.env, args.context)
    runner = EndpointRunner(endpoint, args.env, env_kwargs=env_kwargs, context=args.context,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            concurrency=args.concurrency)
    try:
        result = evaluate(None, args.env, episodes=args.episodes, seed=args.seed, greedy=args.greedy,  # type: ignore[arg-type]
                          runner=runner, batch_size=args.episodes, progress=True)
    except EndpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"endpoint {args.base_url}, model {args.model}, task kwargs {env_kwargs}")
    print(result.table())
    failed = result.stats["failed"]
    print(f"failed episodes {failed} (left out of the rates), retried requests {endpoint.retries}")
    if args.save:
        folder = Path(args.save)
        save_records(result.records, folder)
        gifs = save_gifs(result.records, folder / "gifs")
        (folder / "endpoint.json").write_text(json.dumps(endpoint_summary(args, env_kwargs, result), indent=1),
                                              encoding="utf-8")
        print(f"saved {len(result.records)} records to {folder}" + (f" and {len(gifs)} GIFs" if gifs else ""))
    return 0 if result.episodes else 1


def _known_task(env_id: str, imports: list[str]) -> str:
    """Import ``--import``'s modules and files; what is wrong with them or with ``env_id``, or ``""``."""
    import envs  # noqa: F401  (registers the tasks)
    from envs.cli import import_tasks
    from envs.registry import UnknownTaskError, task_spec

    try:
        import_tasks(imports)
        task_spec(env_id)
    except (ValueError, UnknownTaskError) as exc:
        return str(exc)
    return ""


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--base-url" or a.startswith("--base-url=") for a in args_in):
        return endpoint_main(args_in)
    from envs.cli import ArgumentParser, add_import_flag

    parser = ArgumentParser(prog="python -m agents.evaluate", description=__doc__.split("\n\n")[0],
                                     epilog="--base-url URL --model NAME [--api-key-env VAR]: evaluate a model behind "
                                            "an OpenAI-compatible endpoint instead (--base-url URL -h lists its flags)")
    parser.add_argument("--env", required=True, help="task id, e.g. freshper/FrozenLake-v0")
    add_import_flag(parser)
    parser.add_argument("--model", default=None, help="model folder, .gguf file or known short name (python -m "
                        "agents.pretrained list; default: the embedded tiny model, untrained)")
    parser.add_argument("--system-prompt", default=None, help="a system message before each episode's first user "
                        "message (default: the one the model was trained with, else its chat template's own)")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=EVAL_SEED_BASE, help="first task seed (held-out seeds start at agents.rollout.seeds.EVAL_SEED_BASE = 1900000000)")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    parser.add_argument("--context", default="window:0", help="'window:k' or 'full'")
    parser.add_argument("--kw", nargs="*", default=None, metavar="KEY=VALUE",
                        help="task keyword arguments, e.g. feedback=false (default: train.py's defaults for the task "
                             "and context, so a trained checkpoint sees the prompts it was trained on)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help=MAX_NEW_TOKENS_HELP)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--save", default=None, help="folder for records.jsonl (+ GIFs for image tasks)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="torch device of the model: cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", help="auto|bf16|fp16|fp32 (auto: bf16 on a GPU; on the CPU bf16 for a model of 50M+ parameters where the CPU has bf16 units, else fp32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    configure_threads(args.threads)
    from envs.registry import task_spec

    error = _known_task(args.env, args.imports)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    spec = task_spec(args.env)
    model = args.model
    if model is None:
        from agents.policies.tiny import build_tiny_model

        model = str(build_tiny_model(spec.modality))
    try:
        policy = Policy.from_pretrained(model, device=args.device, dtype=args.dtype)
        if args.threads is None:  # the default depends on the model's size (a real model samples on every core)
            configure_threads(parameters=policy.num_parameters)
        if args.system_prompt is not None:
            policy.set_system_prompt(args.system_prompt)
    except (OSError, ValueError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from agents.rollout.runner import default_env_kwargs
    from envs.play import parse_kwargs

    env_kwargs = parse_kwargs(args.kw) if args.kw is not None else default_env_kwargs(args.env, args.context)
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else run_max_new_tokens(args.model)
    result = evaluate(policy, args.env, episodes=args.episodes, seed=args.seed, greedy=args.greedy,
                      env_kwargs=env_kwargs, context=args.context, max_new_tokens=max_new_tokens,
                      temperature=args.temperature, progress=True)
    print(f"model {model}, task kwargs {env_kwargs}")
    print(result.table())
    if args.save:
        folder = Path(args.save)
        save_records(result.records, folder)
        gifs = save_gifs(result.records, folder / "gifs")
        print(f"saved {len(result.records)} records to {folder}" + (f" and {len(gifs)} GIFs" if gifs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
