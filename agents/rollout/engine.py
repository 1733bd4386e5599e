"""The sampling engine of training rollouts: its settings (``--engine``, ``--vllm-python``,
``--vllm-args``, :class:`EngineSettings` with the typed :class:`VllmSettings`) and the factory
that builds a vLLM sampler for a policy from them and the run's :class:`PolicySpec`
(:func:`vllm_sampler`): the engine computes in the spec's dtype unless ``--vllm-args`` names one,
and serves the spec's LoRA adapters as adapters with ``"lora": "adapter"``."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.policies.spec import PolicySpec
from agents.rollout.runner import RolloutSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM engine's settings, from ``--vllm-args`` (a JSON object of these keys; docs/scaling.md)."""

    dtype: str | None = None
    """vLLM's dtype (float32, bfloat16, float16, auto); default: the policy spec's compute dtype"""
    max_model_len: int | None = None
    """the longest sequence the engine holds; default --max-context-tokens"""
    gpu_memory_utilization: float | None = None
    """the GPU share of the engine; default vLLM's, or with colocate what the learner's measured peak leaves"""
    enforce_eager: bool | None = None
    """no CUDA graphs; default: on CPUs only"""
    weight_sync: str = "memory"
    """how pushed weights reach the engine: memory (a weight group or CUDA IPC) or files (save_pretrained under /dev/shm)"""
    lora: str = "merged"
    """a LoRA policy's weights pushed merged, or its adapters served as adapters (adapter)"""
    colocate: bool = False
    """the engine on the learner's GPU, asleep while the learner updates (GPUs only)"""
    max_images: int = 16
    """images one prompt may hold (vision tasks)"""
    engine_args: dict[str, Any] | None = None
    """further vllm.LLM arguments"""
    bucket_mb: int = 256
    """size of one broadcast bucket of pushed weights"""
    startup_timeout: float = 900.0
    """seconds the engine may take to start"""
    group_timeout: float = 600.0
    """seconds a weight-group collective may wait"""
    threads: int | None = None
    """CPU threads of a CPU engine; default: this process's torch threads"""
    seed: int | None = None
    """the engine's seed; default: the run's"""

    def __post_init__(self) -> None:
        if self.weight_sync not in ("memory", "files"):
            raise ValueError(f"--vllm-args weight_sync must be 'memory' or 'files', got {self.weight_sync!r}")
        if self.lora not in ("adapter", "merged"):
            raise ValueError(f"--vllm-args lora must be 'adapter' or 'merged', got {self.lora!r}")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> VllmSettings:
        """The settings a ``--vllm-args`` object names; an unknown key is an error naming the known ones."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--vllm-args has unknown keys {unknown}; the engine settings are {sorted(known)}")
        return cls(**values)


@dataclass(frozen=True)
class EngineSettings:
    """How training rollouts are sampled: ``"hf"`` (the policy's own sampler) or ``"vllm"`` (a vLLM
    engine in its own process, :class:`agents.engines.vllm_client.VLLMSampler`, with :attr:`vllm`)."""

    engine: str = "hf"
    """sampling engine of training rollouts: 'hf' (the policy's own sampler) or 'vllm' (a vLLM engine in its own process, weights pushed in memory after each update; text tasks and Qwen2-VL/Qwen2.5-VL image tasks)"""
    vllm_python: str | None = None
    """python of the environment vLLM is installed in; default $FRESHPER_VLLM_PYTHON, else .venv-vllm/bin/python, else this one"""
    vllm_args: dict[str, Any] | None = field(default_factory=dict)
    """vLLM engine settings (JSON): dtype (default: the learner's compute dtype), max_model_len (default --max-context-tokens), gpu_memory_utilization, enforce_eager (default: on CPUs only), weight_sync (memory|files), lora (adapter|merged), colocate, max_images, engine_args (further vllm.LLM arguments); docs/scaling.md"""

    def __post_init__(self) -> None:
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"--engine must be hf|vllm, got {self.engine!r}")
        if self.vllm_args is None:  # a saved run config's "none": no settings
            object.__setattr__(self, "vllm_args", {})
        self.vllm  # checks the keys and values  # noqa: B018

    @property
    def vllm(self) -> VllmSettings:
        """``--vllm-args`` as typed settings."""
        return VllmSettings.from_dict(self.vllm_args)


def vllm_sampler(policy: Any, model_path: str | os.PathLike, rollout: RolloutSettings, *, seed: int,
                 engine: EngineSettings, spec: PolicySpec, log_path: str | os.PathLike | None = None) -> Any:
    """A :class:`agents.engines.vllm_client.VLLMSampler` for ``policy`` with ``engine.vllm``: the
    spec's compute dtype (unless the settings name one), the policy's EOS, its never-sampled
    vision tokens and its image sizing; the spec's LoRA adapters are served as adapters with
    ``"lora": "adapter"``, else pushed merged; with ``"colocate": true`` the engine's GPU share is
    what the learner's measured peak leaves (:func:`colocated_memory_share`) unless
    ``gpu_memory_utilization`` is given."""
    from agents.engines.vllm_client import VLLMSampler

    vllm = engine.vllm
    share = vllm.gpu_memory_utilization
    if vllm.colocate and share is None:
        share = colocated_memory_share(policy, rollout.max_context_tokens)
    prepare = None
    if policy.is_vision:
        def prepare(image: np.ndarray) -> np.ndarray:
            return np.asarray(policy.prepare_image(image), dtype=np.uint8)

    return VLLMSampler(model_path, eos_token_id=policy.eos_token_id, suppressed_ids=policy.suppressed_ids,
                       prepare_image=prepare, python=engine.vllm_python, dtype=vllm.dtype or spec.vllm_dtype,
                       max_model_len=vllm.max_model_len or rollout.max_context_tokens,
                       seed=seed if vllm.seed is None else vllm.seed, enforce_eager=vllm.enforce_eager,
                       gpu_memory_utilization=share, engine_args=vllm.engine_args,
                       startup_timeout=vllm.startup_timeout, log_path=log_path, weight_sync=vllm.weight_sync,
                       bucket_mb=vllm.bucket_mb, lora=spec.lora if vllm.lora == "adapter" else None,
                       colocate=vllm.colocate, max_images=vllm.max_images, group_timeout=vllm.group_timeout,
                       threads=vllm.threads)


def colocated_memory_share(policy: Any, max_tokens: int, *, margin_gb: float = 1.0) -> float:
    """The GPU share a colocated engine may take (vLLM's ``gpu_memory_utilization``): what the
    learner's measured peak leaves. The peak is measured here, on the learner's device: one
    forward and backward of a ``max_tokens`` sequence through :meth:`Policy.token_logprobs`
    (weights, gradients, activations), plus Adam's two fp32 moments of every trainable weight
    (allocated at the first step), plus ``margin_gb``. The engine sleeps while the learner
    updates, so the two peaks never meet; while the engine runs, the learner holds less."""
    import torch

    from agents.record import Sample

    device = policy.device
    if device.type != "cuda":
        raise ValueError("colocated mode (vllm_args colocate) needs the learner and the engine on one CUDA GPU: it "
                         "relies on vLLM's sleep mode, which the CPU build does not have (its workers ignore "
                         "sleep/wake_up); on CPUs run the engine beside the learner (docs/scaling.md)")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    n = max(2, int(max_tokens))
    probe = Sample([policy.pad_token_id] * n, [0] + [1] * (n - 1), [0.0] * n)
    policy.model.zero_grad(set_to_none=True)
    policy.token_logprobs([probe]).sum().backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    policy.model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    adam = 8 * sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    total = torch.cuda.get_device_properties(device).total_memory
    share = (total - peak - adam - margin_gb * 2**30) / total
    logger.info("colocated vLLM engine: the learner's measured peak %.1f GiB + Adam %.1f GiB of %.1f GiB leaves "
                "the engine %.0f%%", peak / 2**30, adam / 2**30, total / 2**30, 100 * share)
    if share < 0.05:
        raise ValueError(f"the learner's measured peak ({peak / 2**30:.1f} GiB + Adam {adam / 2**30:.1f} GiB) leaves "
                         f"no room for a colocated engine on this {total / 2**30:.0f} GiB GPU: use LoRA, gradient "
                         "checkpointing or a smaller --max-context-tokens, or run the engine on its own GPU")
    return round(share, 3)
