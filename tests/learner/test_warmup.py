"""The own-answer format warm-up of a real chat model (learner/warmup.py): the answer a free-form
reply states, kept only where the task parses it; the pretraining recipe's checks."""

from __future__ import annotations

import pytest

from learner.pretrain import PretrainSettings, cache_key
from learner.warmup import answer_span


@pytest.mark.parametrize("reply, answer", [
    ("4 + 7 = 11", "11"),
    ("1 - 0.\n\nThe final answer is 1.", "1"),
    ("8 * 2 = 16\n\nThe answer is 16.", "16"),
    ("The answer to this problem is 15.", "15"),
    ("Answer: **-3**", "-3"),
    ("Right", "Right"),
    ("  42  \n", "42"),
])
def test_the_answer_a_reply_states_is_taken_from_its_last_line(reply: str, answer: str) -> None:
    assert answer_span(reply) == answer


@pytest.mark.parametrize("reply", [
    "", "   \n ", "I'm ready to assist you. What's your next question?",
    "FrozenLake: move the player P to the goal G; F is frozen ice, stepping on a hole H",
    "x" * 200,
])
def test_prose_empty_and_overlong_replies_state_no_answer(reply: str) -> None:
    assert answer_span(reply) is None


def test_own_replies_need_a_format_only_recipe_and_leave_the_default_cache_key_as_it_was(tmp_path) -> None:
    PretrainSettings(steps=4, dynamics_fraction=0.0, replies="own", until_exact=0.0)
    for bad in (dict(dynamics_fraction=0.5), dict(dynamics_fraction=0.0, reasoning="lookahead"),
                dict(dynamics_fraction=0.0, success_fraction=0.2)):
        with pytest.raises(ValueError, match="pretrain-replies own"):
            PretrainSettings(steps=4, replies="own", until_exact=0.0, **bad)
    with pytest.raises(ValueError, match="'random' or 'own'"):
        PretrainSettings(replies="mine")
    base = tmp_path / "tiny"
    default = PretrainSettings(steps=None, until_exact=None)
    explicit = PretrainSettings(steps=None, until_exact=None, replies="random")
    own = PretrainSettings(steps=400, dynamics_fraction=0.0, until_exact=0.0, replies="own")
    key = cache_key(base, "freshper/FrozenLake-v0", None, default, 0)
    assert cache_key(base, "freshper/FrozenLake-v0", None, explicit, 0) == key
    assert cache_key(base, "freshper/FrozenLake-v0", None, own, 0) != key


def test_own_replies_wrap_the_models_answers_in_the_tasks_format_and_drop_what_it_refuses() -> None:
    """A stand-in policy whose direct replies are fixed strings: the task's format_reply wraps
    the stated answer, parse_action judges it (FrozenLake refuses a move it does not know)."""
    import numpy as np

    import envs
    from learner.pretrain import Example
    from learner.warmup import DIRECT_SUFFIX, own_replies

    said = {0: "I would go Right.\nRight", 1: "Jump", 2: "Let me think about it for a while."}

    class Gen:
        def __init__(self, k): self.token_ids = [k]

    class Chat:
        def first_message(self, text, images):
            assert text.endswith(DIRECT_SUFFIX)
            return [int(text.split("#")[1].split("\n")[0])]

    class Stub:
        chat = Chat()

        def generate(self, prompts, images, max_new_tokens, greedy):
            assert greedy
            return [Gen(p[0]) for p in prompts]

        def reply_text(self, ids):
            return said[ids[0]]

    env = envs.make("freshper/FrozenLake-v0")
    try:
        examples = [Example(f"board #{k}", [], "<answer>Up</answer>", "format") for k in range(3)]
        wrapped, raw = own_replies(Stub(), examples, env.unwrapped)
    finally:
        env.close()
    assert raw == [said[0], said[1], said[2]]
    assert wrapped[0] == env.unwrapped.format_reply("Right") and wrapped[1] is None and wrapped[2] is None
    assert np.all([w is None or "<answer>" in w for w in wrapped])
