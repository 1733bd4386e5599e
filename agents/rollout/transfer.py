"""Weights and model folders as plain data, for processes that share no memory with the learner:
a model's state as numpy arrays (what the object store carries to Ray rollout workers: zero-copy
reads, where torch tensors were ~30x slower to put; bf16 as its int16 bits), and a model folder
as ``{relative name: bytes}`` (shipped once, so nodes need no shared filesystem)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np


def state_to_numpy(model: Any) -> dict[str, np.ndarray]:
    """A model's state dict as numpy arrays (views of the tensors; bf16 as its int16 bits,
    under a ``bf16:`` key prefix, since numpy has no bf16); a LoRA model's with its adapters
    merged, under the plain model's names."""
    import torch

    from agents.policies.lora import plain_state_dict

    out = {}
    for name, tensor in plain_state_dict(model).items():  # LoRA adapters merged in
        t = tensor.detach().cpu()
        if t.dtype == torch.bfloat16:
            out["bf16:" + name] = t.view(torch.int16).numpy()
        else:
            out[name] = t.numpy()
    return out


def load_numpy_state(model: Any, state: dict[str, np.ndarray]) -> None:
    """Copy arrays from :func:`state_to_numpy` into ``model``'s tensors in place."""
    import torch

    own = model.state_dict()
    names = {k.removeprefix("bf16:") for k in state}
    missing = sorted(set(own) - names)
    if missing:
        raise ValueError(f"pushed weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only; copy_ only reads them
        for key, arr in state.items():
            if key.startswith("bf16:"):
                own[key[5:]].copy_(torch.from_numpy(arr).view(torch.bfloat16))
            else:
                own[key].copy_(torch.from_numpy(arr))


def numpy_weights(state: dict[str, np.ndarray], *, skip_tied_head: bool = False):
    """``(name, tensor)`` pairs of a :func:`state_to_numpy` state (views of the arrays; a tied
    LM head left out: an engine's is its embedding)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # object-store arrays are read-only; they are only read
        for key, arr in state.items():
            name = key.removeprefix("bf16:")
            if skip_tied_head and name.endswith("lm_head.weight"):
                continue
            t = torch.from_numpy(arr)
            yield name, (t.view(torch.bfloat16) if key.startswith("bf16:") else t)


def read_folder(path: str | os.PathLike) -> dict[str, bytes]:
    """Every file under ``path`` by relative name (a model folder shipped to another node)."""
    root = Path(path)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_folder(files: dict[str, bytes], path: str | os.PathLike) -> Path:
    root = Path(path)
    for name, data in files.items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root
