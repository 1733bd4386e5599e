"""Merge a LoRA checkpoint into a full model folder that loads anywhere.

    python -m agents.merge_lora runs/<name>/checkpoints/iter_000200/model merged/ [--dtype bf16]

The adapters' folder names its base model (``adapter_config.json``); the base is loaded, the
adapters' deltas ``B A * alpha / r`` added to its weights, and the result saved in the HF layout
with the tokenizer/processor.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from agents.policies.lora import has_lora, plain_state_dict
from agents.policies.policy import Policy


def merge_to_folder(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "fp32") -> Path:
    """Load an adapter folder with its base, merge, and save the full model to ``out``."""
    policy = Policy.from_pretrained(checkpoint, dtype=dtype)
    if not has_lora(policy.model):
        raise ValueError(f"{checkpoint} holds no LoRA adapters")
    state = plain_state_dict(policy.model)
    base = Policy.from_pretrained(policy.lora_base, dtype=dtype)
    missing, unexpected = base.model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"merged weights do not fit the base model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return base.save_pretrained(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.merge_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a LoRA run's model folder (runs/<name>/checkpoints/iter_N/model)")
    parser.add_argument("out", help="folder for the merged model (HF layout, loadable anywhere)")
    parser.add_argument("--dtype", default="fp32", help="dtype of the saved weights: fp32|bf16|fp16")
    args = parser.parse_args(argv)
    try:
        out = merge_to_folder(args.checkpoint, args.out, args.dtype)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
