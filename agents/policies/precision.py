"""Numeric precision: the ``--dtype`` names, what ``auto`` means on a device, and autocast.

``--dtype`` names the precision the model computes in (``fp32``, ``bf16``, ``fp16``, or ``auto``:
bf16 on a CUDA device that supports it, fp16 on one that does not, fp32 on the CPU). A trained
policy keeps its weights and Adam's state in fp32 and computes under ``torch.autocast`` (mixed
precision, the recipe TRL/accelerate and FSDP2's mixed-precision policy use); a model that only
samples or scores (the KL reference, evaluation, play, the viewer) is loaded in the compute dtype
itself. Log-probabilities are always taken in fp32 (:meth:`agents.policies.policy.Policy.logprobs_of`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

#: ``--dtype`` names (and their long spellings) to torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}
CHOICES = ("auto", "bf16", "fp16", "fp32")


def resolve_dtype(name: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype a ``--dtype`` setting names on ``device`` (``auto`` decided here)."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower()
    device = torch.device(device)
    if key == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if key not in DTYPES:
        raise ValueError(f"--dtype must be one of {'|'.join(CHOICES)}, got {name!r}")
    return DTYPES[key]


def vllm_dtype(dtype: torch.dtype) -> str:
    """The name vLLM's ``dtype`` argument takes for ``dtype``."""
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


@contextlib.contextmanager
def autocast(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast`` to ``dtype`` on ``device``; nothing for fp32 (the default runs bit for
    bit as without it)."""
    device = torch.device(device)
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield
