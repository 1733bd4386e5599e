"""``--dtype auto`` on the CPU: bf16 only for a large model on a CPU that multiplies bf16 in
hardware, fp32 otherwise; a model's size read from its folder without loading it; the run warns
where bf16 is asked for on a CPU that emulates it.

Whether this CPU has bf16 units is hardware, so the tests that need the other answer set
:func:`agents.policies.precision.cpu_bf16_native` for the call; everything else is real (saved
model folders, the run's own settings, the loader)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agents.policies import precision
from agents.policies.lora import LoraSettings, add_lora
from agents.policies.policy import Policy
from agents.policies.tiny import build_tiny_model
from agents.pretrained import KNOWN_MODELS, model_parameters
from learner.config import make_config, policy_spec, precision_warning


def _native(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(precision, "cpu_bf16_native", lambda: native)


def test_the_probe_is_torchs_own() -> None:
    import torch.cpu

    expected = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert precision.cpu_bf16_native() is bool(expected)


@pytest.mark.parametrize("native", [False, True])
def test_auto_on_the_cpu_is_bf16_only_for_a_large_model_on_bf16_units(monkeypatch: pytest.MonkeyPatch,
                                                                       native: bool) -> None:
    _native(monkeypatch, native)
    large = precision.LARGE_MODEL_PARAMETERS
    assert precision.resolve_dtype("auto", "cpu", large) == (torch.bfloat16 if native else torch.float32)
    assert precision.resolve_dtype("auto", "cpu", large - 1) == torch.float32  # the tiny models keep fp32
    assert precision.resolve_dtype("auto", "cpu", None) == torch.float32  # size not known: fp32
    assert precision.resolve_dtype("bf16", "cpu", 1) == torch.bfloat16  # a named dtype is taken as it is
    assert precision.resolve_dtype("fp32", "cpu", large) == torch.float32
    assert precision.emulated_bf16(torch.bfloat16, "cpu") is (not native)
    assert not precision.emulated_bf16(torch.float32, "cpu")


def test_a_folders_parameters_are_read_from_its_safetensors_headers(tmp_path: Path) -> None:
    folder = Path(build_tiny_model("text", cache_dir=tmp_path / "cache"))
    loaded = Policy.from_pretrained(folder)
    assert model_parameters(folder) == sum(p.numel() for p in loaded.model.parameters())
    add_lora(loaded, LoraSettings(rank=4))
    adapters = loaded.save_pretrained(tmp_path / "adapters")  # an adapter folder: its base's count
    assert (Path(adapters) / "adapter_config.json").is_file()
    assert model_parameters(adapters) == model_parameters(folder)
    assert model_parameters("smollm2-135m-instruct") == KNOWN_MODELS["smollm2-135m-instruct"].parameters
    assert model_parameters("some-org/some-model") is None and model_parameters(None) is None
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    assert model_parameters(damaged) is None
    (damaged / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{x")
    assert model_parameters(damaged) is None


def test_a_run_and_the_loader_resolve_auto_by_the_models_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = Path(build_tiny_model("text", cache_dir=tmp_path / "cache"))
    size = model_parameters(folder)
    _native(monkeypatch, True)
    assert policy_spec(make_config(model=str(folder))).compute_dtype == torch.float32  # tiny: fp32
    assert policy_spec(make_config()).compute_dtype == torch.float32  # the embedded model: fp32
    monkeypatch.setattr(precision, "LARGE_MODEL_PARAMETERS", size)  # as if it were large
    assert policy_spec(make_config(model=str(folder))).compute_dtype == torch.bfloat16
    assert policy_spec(make_config(model=str(folder), dtype="fp32")).compute_dtype == torch.float32
    assert Policy.from_pretrained(folder, dtype="auto").model.dtype == torch.bfloat16
    trained = Policy.from_pretrained(folder, dtype=torch.float32, compute_dtype="auto")
    assert trained.model.dtype == torch.float32 and trained.compute_dtype == torch.bfloat16
    _native(monkeypatch, False)
    assert policy_spec(make_config(model=str(folder))).compute_dtype == torch.float32
    assert Policy.from_pretrained(folder, dtype="auto").model.dtype == torch.float32


def test_the_run_warns_where_bf16_is_emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    _native(monkeypatch, False)
    warning = precision_warning(make_config(dtype="bf16"))
    assert warning is not None and "emulated" in warning and "--dtype auto" in warning
    assert precision_warning(make_config(dtype="fp32")) is None
    assert precision_warning(make_config()) is None
    _native(monkeypatch, True)
    assert precision_warning(make_config(dtype="bf16")) is None


def test_train_prints_the_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import learner.run
    import train

    _native(monkeypatch, False)
    runs = []
    monkeypatch.setattr(learner.run, "train", runs.append)  # the run itself is not what is tested here
    assert train.main(["--dtype", "bf16", "--runs-root", str(tmp_path)]) == 0 and len(runs) == 1
    assert "warning: bf16 compute on this CPU is emulated" in capsys.readouterr().err
    assert train.main(["--runs-root", str(tmp_path)]) == 0
    assert "emulated" not in capsys.readouterr().err


def test_the_recipes_ask_for_auto() -> None:
    import yaml

    root = Path(__file__).resolve().parents[3] / "configs"
    for name in ("real_arithmetic", "real_countdown", "real_frozenlake", "paper_real_arithmetic"):
        assert yaml.safe_load((root / f"{name}.yaml").read_text())["dtype"] == "auto", name
