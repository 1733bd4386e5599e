"""The policy spec travels by argument: nothing of the project is stored on a model object, a LoRA
policy's settings are the policy's, and the engine settings are typed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from agents.policies.lora import LoraSettings, add_lora, has_lora
from agents.policies.policy import Policy
from agents.policies.spec import PolicySpec
from agents.policies.tiny import build_tiny_model
from agents.rollout.engine import EngineSettings, VllmSettings

REPO = Path(__file__).resolve().parents[3]


def _project_attributes(model: torch.nn.Module) -> list[str]:
    return [f"{name or 'model'}.{key}" for name, module in model.named_modules() for key in vars(module)
            if key.startswith("freshper")]


def test_no_module_assigns_a_project_attribute_to_an_object() -> None:
    """``x.freshper_... = ...`` appears nowhere in the packages that hold models: settings are arguments."""
    offenders = []
    for package in ("agents", "learner"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr.startswith("freshper"):
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno} .{target.attr}")
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and \
                        len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                        str(node.args[1].value).startswith("freshper"):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno} setattr {node.args[1].value}")
    assert not offenders, offenders


def test_a_lora_policy_keeps_its_settings_on_the_policy_not_the_model(tmp_path: Path) -> None:
    policy = Policy.from_pretrained(build_tiny_model("text"))
    assert not has_lora(policy.model) and policy.lora is None
    settings = LoraSettings(rank=4)
    add_lora(policy, settings)
    assert has_lora(policy.model) and policy.lora == settings
    assert _project_attributes(policy.model) == []
    saved = policy.save_pretrained(tmp_path / "adapters")
    back = Policy.from_pretrained(saved)
    assert has_lora(back.model) and back.lora == settings and back.lora_base == policy.lora_base
    assert _project_attributes(back.model) == []


def test_the_spec_resolves_the_dtype_once_and_drops_rank_zero() -> None:
    spec = PolicySpec.resolve("auto", "cpu", LoraSettings(rank=0))
    assert spec == PolicySpec(torch.float32, None) and spec.lora_rank == 0 and spec.vllm_dtype == "float32"
    bf16 = PolicySpec.resolve("bf16", "cpu", LoraSettings(rank=8))
    assert bf16.compute_dtype == torch.bfloat16 and bf16.lora_rank == 8 and bf16.vllm_dtype == "bfloat16"
    assert bf16.merged() == PolicySpec(torch.bfloat16, None)
    with pytest.raises(TypeError, match="torch dtype"):
        PolicySpec("bf16")  # type: ignore[arg-type]


def test_vllm_args_are_typed_settings() -> None:
    engine = EngineSettings("vllm", None, {"colocate": True, "weight_sync": "files", "max_images": 4})
    assert engine.vllm == VllmSettings(colocate=True, weight_sync="files", max_images=4)
    assert engine.vllm_args == {"colocate": True, "weight_sync": "files", "max_images": 4}  # the saved form
    assert EngineSettings(vllm_args=None).vllm == VllmSettings()
    with pytest.raises(ValueError, match="unknown keys \\['colocated'\\]"):
        EngineSettings("vllm", None, {"colocated": True})
    with pytest.raises(ValueError, match="lora must be"):
        EngineSettings("vllm", None, {"lora": "both"})


def test_rollout_threads_default_to_one_for_small_models_and_every_core_for_large_ones_on_two_cpus():
    import os

    from agents.policies.policy import LARGE_MODEL_PARAMETERS, configure_threads

    cpus = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        if cpus <= 2:
            assert configure_threads() == 1 == torch.get_num_threads()
            assert configure_threads(parameters=LARGE_MODEL_PARAMETERS) == cpus == torch.get_num_threads()
        else:
            assert configure_threads(parameters=LARGE_MODEL_PARAMETERS) == configure_threads() == min(8, cpus // 2)
        assert configure_threads(3, parameters=LARGE_MODEL_PARAMETERS) == 3  # a given count wins
    finally:
        torch.set_num_threads(before)
