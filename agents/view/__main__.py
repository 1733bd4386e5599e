"""``python -m agents.view [RUNS]``: serve the viewer on http://127.0.0.1:8765 (docs/view.md).

Needs the optional extra: ``pip install -e '.[view]'`` (Starlette and uvicorn). Binds to the
loopback interface unless ``--host`` says otherwise; nothing is loaded from other machines.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, build the app and serve it until interrupted; 2 on a bad folder."""
    from envs.cli import ArgumentParser, add_import_flag, import_tasks

    parser = ArgumentParser(prog="python -m agents.view", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="?", default="runs", help="a folder of run folders, or one run folder (default: runs)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--play-dir", default=None, help="where saved play episodes go (default: RUNS/play)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads for play (default: agents.policies.policy's)")
    parser.add_argument("--device", default="cpu", help="torch device play loads models on: cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", help="auto|bf16|fp16|fp32: the precision play loads models in "
                                                       "(auto: bf16 on a GPU that supports it; on the CPU bf16 for a model of 50M+ "
                                                       "parameters where the CPU has bf16 units, else fp32)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="the model's reply length limit in play, in tokens")
    add_import_flag(parser)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    try:
        import envs  # noqa: F401  (the registered tasks: the play pages list them)

        import_tasks(args.imports)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("PIL", "httpx", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        import uvicorn

        from agents.view.app import LOOPBACK_HOSTS, create_app, is_loopback
    except ImportError as exc:
        print(f"error: the viewer needs the optional extra: pip install -e '.[view]' ({exc})", file=sys.stderr)
        return 2
    from agents.view.runs import ViewError

    try:
        from agents.policies.policy import resolve_device
        from agents.policies.precision import resolve_dtype

        device = str(resolve_device(args.device))
        resolve_dtype(args.dtype, device)
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        # Any loopback bind (127.0.0.2 too) keeps the Host check: a page elsewhere cannot read the
        # runs through DNS rebinding. The Origin check of POSTs holds for every bind.
        loopback = is_loopback(args.host)
        hosts = [*LOOPBACK_HOSTS, args.host.strip("[]"), f"[{args.host.strip('[]')}]"] if loopback else ["*"]
        app = create_app(args.runs, args.play_dir, allowed_hosts=hosts, device=device, dtype=args.dtype,
                         max_new_tokens=args.max_new_tokens, threads=args.threads)
    except ViewError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from agents.policies.policy import configure_threads

    configure_threads(args.threads)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    if not loopback:
        print(f"warning: serving on {args.host}: anyone who can reach this machine can see the runs and load models",
              file=sys.stderr)
    viewer = app.state.viewer
    print(f"freshper viewer: http://{args.host}:{args.port}/  (runs in {viewer.root}, played episodes saved to "
          f"{viewer.play_dir}; play on {device}, dtype {args.dtype}; Ctrl-C stops)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
