"""An optional system prompt (``--system-prompt``): rendered before the first user message by the
model's own template, saved with the model and read back wherever the folder is loaded."""

from __future__ import annotations

import pytest

from agents.policies.policy import Policy
from agents.policies.tiny import build_tiny_model


def test_the_system_prompt_renders_first_travels_with_the_folder_and_can_be_cleared(tmp_path) -> None:
    policy = Policy.from_pretrained(build_tiny_model("text"))
    plain = policy.decode(policy.chat.first_message("Move."))
    assert policy.system_prompt is None and "system" not in plain
    policy.set_system_prompt("Answer in tags.")
    first = policy.decode(policy.chat.first_message("Move."))
    assert first.index("Answer in tags.") < first.index("Move.") and first.endswith(plain[plain.index("Move."):])
    # later messages are rendered as before: the system message is the conversation's head only
    assert policy.chat.next_message("Move.") == Policy.from_pretrained(build_tiny_model("text")).chat.next_message("Move.")
    saved = Policy.from_pretrained(policy.save_pretrained(tmp_path / "m"))
    assert saved.system_prompt == "Answer in tags." and saved.chat.first_message("Move.") == policy.chat.first_message("Move.")
    policy.set_system_prompt(None)
    assert Policy.from_pretrained(policy.save_pretrained(tmp_path / "m")).system_prompt is None


def test_damaged_chat_settings_are_a_clear_error(tmp_path) -> None:
    folder = Policy.from_pretrained(build_tiny_model("text")).save_pretrained(tmp_path / "m")
    (folder / "freshper_chat.json").write_text('{"system_prompt": 3}')
    with pytest.raises(ValueError, match="system_prompt must be a string"):
        Policy.from_pretrained(folder)
