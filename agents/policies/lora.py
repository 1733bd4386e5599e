"""LoRA adapters on a policy through peft: train a few million parameters of a billion-size model.

:func:`add_lora` injects peft's LoRA layers into the policy's own HF model in place (the model
keeps its class, so the sampler, the learner's prefix-sharing pass and the vision code see the
same object), freezes every base weight and keeps the adapters in fp32 while the base may be
bf16. The KL reference is the same model with its adapters switched off
(:func:`adapters_disabled`): no second copy of the weights.

A LoRA policy saves the adapters alone, in peft's layout (``adapter_model.safetensors`` and
``adapter_config.json`` naming the base folder, plus the tokenizer/processor), so a checkpoint
is megabytes and opens with peft's own ``PeftModel.from_pretrained`` too;
:meth:`agents.policies.policy.Policy.from_pretrained` recognises such a folder and loads base and
adapters. ``python -m agents.merge_lora CHECKPOINT OUT`` writes the merged full model.
Rollout workers and engines that take pushed weights receive the merged weights
(:func:`plain_state_dict`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Projection layers of the Qwen2 / Qwen2.5 / Llama decoder family (``all-linear`` targets them).
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: peft's key prefix of a PeftModel's saved adapter weights.
_PEFT_PREFIX = "base_model.model."


@dataclass
class LoraSettings:
    """LoRA adapters: ``train.py``'s ``lora`` settings (``--lora-rank``, ``--lora-alpha``,
    ``--lora-targets``, ``--lora-dropout``; ``learner.config``); rank 0: none, every weight trains."""

    rank: int = field(default=0, metadata={"locked": True})
    """train LoRA adapters of this rank on the language model's projections instead of every weight (0: full fine-tuning); the base stays frozen (in --dtype), the KL reference is the base with the adapters off, checkpoints hold the adapters alone (python -m agents.merge_lora merges one)"""
    alpha: float | None = field(default=None, metadata={"locked": True})
    """LoRA scale alpha (the update is B A alpha / rank); default 2 x --lora-rank"""
    targets: str = field(default="all-linear", metadata={"locked": True})
    """LoRA target modules: 'all-linear' (q,k,v,o,gate,up,down projections of the language model; never the vision tower or the LM head) or a comma-separated list of module names, e.g. q_proj,v_proj"""
    dropout: float = field(default=0.0, metadata={"locked": True})
    """dropout on the LoRA branch's input while training"""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {self.rank}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        if not self.targets or not all(re.fullmatch(r"[A-Za-z0-9_]+", t) for t in self.target_names()):
            raise ValueError(f"--lora-targets must be 'all-linear' or a comma-separated list of module names "
                             f"(e.g. q_proj,v_proj), got {self.targets!r}")

    def target_names(self) -> tuple[str, ...]:
        if self.targets == "all-linear":
            return LINEAR_TARGETS
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    def target_regex(self) -> str:
        """The modules adapted: the named projections of the language model, never the vision
        tower (a VLM's ``visual`` blocks have projections of the same names) or the LM head."""
        names = "|".join(re.escape(t) for t in self.target_names())
        return rf"^(?!.*visual).*\.({names})$"

    def peft_config(self):
        from peft import LoraConfig

        return LoraConfig(r=int(self.rank), lora_alpha=float(self.alpha or 2 * self.rank),
                          target_modules=self.target_regex(), lora_dropout=float(self.dropout), bias="none")


def lora_layers(model) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def has_lora(model) -> bool:
    """Whether ``model`` carries LoRA adapters (:func:`add_lora`): peft's LoRA layers in it
    (a sharded model's too; their settings are the policy's, :attr:`Policy.lora`)."""
    return any(hasattr(m, "lora_A") for m in model.modules())


def add_lora(policy, settings: LoraSettings) -> None:
    """Inject LoRA adapters into ``policy.model`` in place: base weights frozen, adapters in fp32
    (their initial ``B = 0`` leaves the policy's outputs unchanged)."""
    from peft import inject_adapter_in_model

    if settings.rank < 1:
        raise ValueError(f"--lora-rank must be >= 1 to add adapters, got {settings.rank}")
    if has_lora(policy.model):
        raise ValueError("the policy already carries LoRA adapters")
    model = policy.model
    for p in model.parameters():
        p.requires_grad_(False)
    try:
        inject_adapter_in_model(settings.peft_config(), model)
    except ValueError as exc:
        if "not found" not in str(exc):
            raise
    layers = lora_layers(model)
    if not layers:
        raise ValueError(f"--lora-targets {settings.targets!r} matches no layer of {type(model).__name__}; "
                         f"its linear layers include {sorted(_linear_names(model))[:12]}")
    device = policy.device
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(device=device, dtype=torch.float32)
            p.requires_grad_(True)
    policy.lora = settings
    policy.lora_base = policy.name


def _linear_names(model) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """The base model alone inside (the KL reference); the adapters back on after."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """The adapters' weights under peft's saved names."""
    from peft import get_peft_model_state_dict

    return {_PEFT_PREFIX + k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def save_adapter(policy, path: str | os.PathLike) -> Path:
    """Write the adapters (peft's layout) and the tokenizer/processor to ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = policy.model
    settings: LoraSettings = policy.lora
    config = settings.peft_config().to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    base = str(policy.lora_base)
    config["base_model_name_or_path"] = str(Path(base).resolve()) if Path(base).exists() else base
    config["freshper"] = {"rank": settings.rank, "alpha": settings.alpha, "targets": settings.targets,
                          "dropout": settings.dropout}
    save_file(adapter_state_dict(model), str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1, default=str), encoding="utf-8")
    if policy.processor is not None:
        policy.processor.save_pretrained(path)
    policy.tokenizer.save_pretrained(path)
    return path


def read_adapter_config(path: str | os.PathLike) -> tuple[dict[str, Any], LoraSettings, Path]:
    """An adapter folder's config, its settings and its base folder (which must exist)."""
    path = Path(path)
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path / ADAPTER_CONFIG} is unreadable: {exc}") from None
    own = config.get("freshper") or {}
    targets = own.get("targets")
    if targets is None:  # an adapter folder written by peft itself
        modules = config.get("target_modules") or list(LINEAR_TARGETS)
        targets = ",".join(modules) if isinstance(modules, list) else "all-linear"
    settings = LoraSettings(rank=int(own.get("rank", config.get("r", 8))),
                            alpha=own.get("alpha", config.get("lora_alpha")), targets=targets,
                            dropout=float(own.get("dropout", config.get("lora_dropout", 0.0)) or 0.0))
    base = Path(str(config.get("base_model_name_or_path") or ""))
    if not base.is_dir():
        raise FileNotFoundError(f"{path} holds LoRA adapters for the base model {str(base)!r}, which is not a folder "
                                "here: restore the base model there (or edit base_model_name_or_path in "
                                f"{path / ADAPTER_CONFIG})")
    return config, settings, base


def load_adapter_policy(cls, path: Path, *, device: torch.device, dtype: torch.dtype, compute_dtype: torch.dtype):
    """The base policy of an adapter folder with the folder's adapters on it."""
    from safetensors.torch import load_file

    _, settings, base = read_adapter_config(path)
    policy = cls.from_pretrained(base, device=device, dtype=dtype, compute_dtype=compute_dtype)
    add_lora(policy, settings)
    try:
        saved = load_file(str(path / ADAPTER_WEIGHTS))
    except Exception as exc:  # noqa: BLE001 - a damaged file: say which
        raise ValueError(f"{path / ADAPTER_WEIGHTS} is unreadable: {exc}") from None
    load_adapter_weights(policy.model, saved)
    policy.name = str(path)
    from agents.policies.chat import read_system_prompt

    policy.set_system_prompt(read_system_prompt(path))  # the adapter folder's own, not its base's
    return policy


def load_adapter_weights(model, saved: dict[str, torch.Tensor]) -> None:
    """Copy saved adapter weights (peft's names) into ``model``'s adapters; all must match."""
    from peft import set_peft_model_state_dict

    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in saved.items()}
    own = {k.removeprefix(_PEFT_PREFIX) for k in adapter_state_dict(model)}
    if set(state) != own:
        missing, extra = sorted(own - set(state))[:3], sorted(set(state) - own)[:3]
        raise ValueError(f"the saved adapters do not fit the model (missing {missing}, unexpected {extra})")
    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"the saved adapters do not fit the model: unexpected {unexpected[:3]}")


def plain_state_dict(model) -> dict[str, torch.Tensor]:
    """``model``'s weights under its own (HF) names with any LoRA adapters merged in: what a
    sampler holding the plain model loads."""
    if not has_lora(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        merged = {}
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                base = module.get_base_layer()
                weight = base.weight
                delta = module.get_delta_weight("default").to(weight.dtype) if module.merged is False else 0
                merged[name + ".weight"] = (weight + delta).detach()
                if getattr(base, "bias", None) is not None:
                    merged[name + ".bias"] = base.bias.detach()
        for key, value in model.state_dict().items():
            if "lora_" in key:
                continue
            plain = key.replace(".base_layer.", ".")
            out[plain] = merged.get(plain, value)
    return out
