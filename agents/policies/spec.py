"""What a policy is beyond its weights, as one value handed by argument to whatever loads, plays
or serves it: the precision it computes in and its LoRA adapters.

A run resolves its ``--dtype`` and ``--lora-*`` settings into one :class:`PolicySpec` before it
builds anything (``learner.config.Resolved``) and passes it on: to the learner that loads the
policy, to the sampler and the vLLM engine (``agents.rollout.engine.vllm_sampler``: the engine's
dtype and the adapters it serves) and to each Ray rollout worker (``agents.rollout.workers``).
Nothing of it is stored on the model object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.policies.lora import LoraSettings
from agents.policies.precision import resolve_dtype, vllm_dtype


@dataclass(frozen=True)
class PolicySpec:
    """The compute dtype of a policy (its forward passes; below fp32 under autocast over fp32
    weights, or in the weights' own dtype where they are loaded in it) and its LoRA adapters
    (None: every weight trains)."""

    compute_dtype: torch.dtype = torch.float32
    lora: LoraSettings | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.compute_dtype, torch.dtype):
            raise TypeError(f"compute_dtype must be a torch dtype (resolve a --dtype name with PolicySpec.resolve), "
                            f"got {self.compute_dtype!r}")
        if self.lora is not None and self.lora.rank < 1:
            object.__setattr__(self, "lora", None)  # rank 0: no adapters

    @classmethod
    def resolve(cls, dtype: str | torch.dtype, device: torch.device | str, lora: LoraSettings | None = None,
                parameters: int | None = None) -> PolicySpec:
        """The spec of ``--dtype`` on ``device`` (``auto`` decided there, for a model of
        ``parameters`` parameters) with ``lora``'s adapters."""
        return cls(resolve_dtype(dtype, device, parameters), lora)

    @property
    def lora_rank(self) -> int:
        """The adapters' rank (0: none)."""
        return self.lora.rank if self.lora is not None else 0

    @property
    def vllm_dtype(self) -> str:
        """The name of :attr:`compute_dtype` that vLLM's ``dtype`` takes."""
        return vllm_dtype(self.compute_dtype)

    def merged(self) -> PolicySpec:
        """This spec for a copy that holds the merged weights (a rollout worker's policy)."""
        return PolicySpec(self.compute_dtype, None)
