"""Loading a saved model folder's weights into a live policy in place.

:func:`load_weights_into` reads the safetensors files of a model folder (or a LoRA adapter
folder) straight into the policy's own tensors, so switching a run to its best policy needs no
second model in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def load_weights_into(policy, folder: str | os.PathLike) -> None:
    """Copy the weights saved in ``folder`` (``save_pretrained``'s layout, sharded or not; or
    LoRA adapters) into ``policy.model``; every tensor the model owns must be found, apart from
    ones tied to another (the LM head tied to the embeddings)."""
    from safetensors.torch import load_file

    from agents.policies.lora import ADAPTER_WEIGHTS, has_lora, load_adapter_weights

    folder = Path(folder)
    if has_lora(policy.model):
        load_adapter_weights(policy.model, load_file(str(folder / ADAPTER_WEIGHTS)))
        return
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    own = policy.model.state_dict()
    rename = _checkpoint_names(policy.model)
    seen: set[str] = set()
    with torch.no_grad():
        for name in files:
            for saved, value in load_file(str(folder / name)).items():
                key = saved if saved in own else rename(saved)
                if key not in own:
                    raise ValueError(f"{folder / name} holds {saved!r}, which {type(policy.model).__name__} lacks")
                own[key].copy_(value)
                seen.add(key)
    tied = _tied_names(policy.model)
    missing = sorted(k for k in set(own) - seen if k not in tied)
    if missing:
        raise ValueError(f"{folder} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")


def _checkpoint_names(model):
    """The function from a saved tensor's name to the live model's, where the two differ:
    ``save_pretrained`` writes some models under their checkpoint layout (Qwen2-VL's
    ``model.embed_tokens.weight`` is ``model.language_model.embed_tokens.weight`` in the live
    model), and ``from_pretrained`` renames them back by the model's conversion mapping. The same
    renames, applied in their order (plain renames only: a checkpoint that needs its tensors
    converted or re-prefixed is loaded with ``from_pretrained``)."""
    import re

    rules: list[tuple[re.Pattern[str], str]] = []
    try:
        from transformers.modeling_utils import get_model_conversion_mapping

        for rule in get_model_conversion_mapping(model):
            if type(rule).__name__ == "WeightRenaming":  # a PrefixChange serves checkpoints saved without the prefix
                targets = list(rule.target_patterns)
                for i, source in enumerate(rule.source_patterns):
                    rules.append((re.compile(source), targets[min(i, len(targets) - 1)]))
    except (ImportError, AttributeError, TypeError):  # a transformers without conversion mappings saves live names
        pass

    def rename(key: str) -> str:
        for pattern, target in rules:
            key = pattern.sub(target, key, count=1)
        return key

    return rename


def _tied_names(model) -> set[str]:
    """State-dict names that share storage with another name (tied weights are saved once)."""
    by_ptr: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_ptr.setdefault(value.data_ptr(), []).append(key)
    return {k for keys in by_ptr.values() if len(keys) > 1 for k in keys}
