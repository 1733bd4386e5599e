"""Numeric precision: the ``--dtype`` names, what ``auto`` means on a device, and autocast.

``--dtype`` names the precision the model computes in (``fp32``, ``bf16``, ``fp16``, or ``auto``:
bf16 on a CUDA device that supports it, fp16 on one that does not; on the CPU, bf16 for a model of
:data:`LARGE_MODEL_PARAMETERS` or more parameters where the CPU multiplies bf16 in hardware
(:func:`cpu_bf16_native`), fp32 otherwise). Without AVX512-BF16 or AMX a bf16 matrix product is
emulated and runs several times slower than fp32 (``benchmarks/precision_bench.py``); small
models gain nothing from bf16 and keep fp32, bit for bit as before. A trained
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

#: A real-size model, where the embedded tiny ones (~1-4M parameters) are far below: ``auto``
#: computes it in bf16 on a CPU with bf16 units, it samples on every core of a 2-CPU machine
#: (:func:`agents.policies.policy.configure_threads`) and the learner packs its short or padded
#: batches on the CPU (:func:`learner.prefix.packing_pays`).
LARGE_MODEL_PARAMETERS = 50_000_000


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX tiles, as torch's
    own CPU probe reports them); False where the probe is missing."""
    import torch.cpu

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, probe, None)
        try:
            if check is not None and check():
                return True
        except (RuntimeError, AttributeError):
            continue
    return False


def emulated_bf16(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether computing in ``dtype`` on ``device`` means bf16 on a CPU without bf16 units."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_bf16_native()


EMULATED_BF16 = ("bf16 compute on this CPU is emulated (it has neither AVX512-BF16 nor AMX): matrix products run "
                 "3-6x slower than in fp32 (benchmarks/precision_bench.py); --dtype auto picks fp32 here")


def resolve_dtype(name: str | torch.dtype, device: torch.device | str = "cpu", parameters: int | None = None) -> torch.dtype:
    """The torch dtype a ``--dtype`` setting names on ``device`` (``auto`` decided here, for a
    model of ``parameters`` parameters on the CPU; None: not known, fp32)."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).lower()
    device = torch.device(device)
    if key == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        large = parameters is not None and parameters >= LARGE_MODEL_PARAMETERS
        return torch.bfloat16 if large and device.type == "cpu" and cpu_bf16_native() else torch.float32
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
