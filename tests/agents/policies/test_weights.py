"""Loading a saved folder's weights into a live policy in place (the run's best checkpoint)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from agents.policies.policy import Policy  # noqa: E402
from agents.policies.tiny import build_tiny_model  # noqa: E402
from agents.policies.weights import load_weights_into  # noqa: E402


@pytest.mark.parametrize("modality", ["text", "vision", "qwen2.5-vl"])
def test_a_saved_policy_loads_back_in_place_whatever_names_its_checkpoint_uses(tmp_path, modality):
    """save_pretrained writes a Qwen2-VL under its checkpoint names (``model.embed_tokens``, not
    the live ``model.language_model.embed_tokens``): loading it back into a live policy renames
    them as from_pretrained does, and every tensor arrives."""
    if modality == "qwen2.5-vl":  # the real Qwen2.5-VL checkpoint layout
        from conftest import build_tiny_qwen25vl

        base = build_tiny_qwen25vl(tmp_path / "qwen25vl")
    else:
        base = build_tiny_model(modality, cache_dir=tmp_path / "cache")
    policy = Policy.from_pretrained(base)
    trained = Policy.from_pretrained(base)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    trained.save_pretrained(tmp_path / "trained")
    load_weights_into(policy, tmp_path / "trained")
    mine, theirs = policy.model.state_dict(), trained.model.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(ValueError, match="lacks"):
        (tmp_path / "other").mkdir()
        from safetensors.torch import save_file

        save_file({"not.a.tensor.of.this.model": torch.zeros(2)}, str(tmp_path / "other" / "model.safetensors"))
        load_weights_into(policy, tmp_path / "other")
