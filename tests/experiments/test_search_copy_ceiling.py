"""The copy ceiling's cases and model: answerable held-out prompts, the size asked for."""

from __future__ import annotations

import pytest

from experiments.searchqa.search_copy_ceiling import cases, greedy_em, sized_model


def test_cases_are_prompts_after_a_search_whose_passages_hold_the_answer() -> None:
    from envs.search.metrics import normalize_answer

    test, looked = cases("test", 6)
    train, _ = cases("train", 6)
    assert len(test) == 6 and looked >= 6
    for prompt, golds in test + train:
        assert prompt.startswith("Answer the question.") and "<information>" in prompt  # the window:0 prompt of turn 2
        assert any(normalize_answer(g) in normalize_answer(prompt) for g in golds)
    assert {p for p, _ in test}.isdisjoint(p for p, _ in train)  # held-out questions are the test split's


def test_a_sized_model_has_the_asked_decoder_and_the_task_tokenizer(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FRESHPER_CACHE", str(tmp_path / "cache"))
    from agents.policies.policy import Policy
    from agents.rollout.runner import default_env_kwargs
    from agents.policies.tiny import task_model

    base = task_model("freshper/SearchQA-v0", default_env_kwargs("freshper/SearchQA-v0", "window:0"))
    policy = Policy.from_pretrained(sized_model(base, 192, 2, 0, tmp_path / "m"))
    cfg = policy.model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (192, 2, 6)
    assert len(policy.tokenizer) == len(Policy.from_pretrained(base).tokenizer)
    em, tagged = greedy_em(policy, cases("test", 2)[0])  # an untrained model: no answer, measured as such
    assert em == pytest.approx(0.0) and 0.0 <= tagged <= 1.0
