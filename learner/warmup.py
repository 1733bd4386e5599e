"""The format warm-up of a real chat model from its own answers (``--pretrain-replies own``).

A small instruct model often knows the answer to a task's question but not the task's reply
format: asked in the task's prompt, it reasons in prose and never writes ``<answer>``, so every
reply is invalid, every GRPO group's rewards are equal and RL has no signal. The random-reply
warm-up the embedded model uses (:mod:`learner.pretrain`'s format examples) teaches the format but
also teaches a random answer, and the model forgets what it knew.

This warm-up keeps what the model knows. For each task prompt of the warm-up it asks the model
the same prompt with :data:`DIRECT_SUFFIX` ("reply with only the final answer"), greedily, and
takes the answer out of that reply (:func:`answer_span`: the last line, after its last ``=``,
``is`` or ``:``); the example is then the task prompt as RL shows it -> the task's own
well-formed reply around that answer (``task.format_reply``), kept only where the task parses
it. No reward and no reference answer is used: the model learns the format around its own
answers, right or wrong.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

#: What the direct question adds to the task's prompt.
DIRECT_SUFFIX = "\n\nReply with only the final answer, nothing else."
#: Tokens the model may spend on a direct answer.
DIRECT_TOKENS = 24
#: An answer with more than this many words holding letters is prose, not an answer.
MAX_WORDS = 1
_SEPARATORS = ("=", " is ", ":")


def answer_span(reply: str, max_chars: int = 40) -> str | None:
    """The final answer a free-form reply states, or None: its last non-empty line, after the
    last ``=``, `` is `` or ``:`` on it, stripped of spaces, trailing full stops, quotes and
    ``**``; None when that is empty, longer than ``max_chars`` or more than :data:`MAX_WORDS`
    word(s) of letters (a sentence, not an answer)."""
    lines = [line.strip() for line in str(reply).strip().splitlines() if line.strip()]
    if not lines:
        return None
    span = lines[-1]
    for sep in _SEPARATORS:
        if sep in span:
            span = span.rsplit(sep, 1)[1]
    span = span.replace("**", "").strip().strip("\"'`").rstrip(".").strip()
    if not span or len(span) > max_chars:
        return None
    if sum(1 for word in span.split() if re.search(r"[A-Za-z]", word)) > MAX_WORDS:
        return None
    return span


def own_replies(policy, examples: Sequence[Any], task: Any, *, batch: int = 64,
                progress: bool = False) -> tuple[list[str | None], list[str]]:
    """Per example, the task's well-formed reply around the model's own direct answer to its
    prompt, or None where no usable answer came out; and the model's raw direct replies.

    ``task`` is an instance of the examples' task (its ``format_reply`` and ``parse_action``
    judge the reply; they do not depend on the episode's state)."""
    from tqdm.auto import tqdm

    wrapped: list[str | None] = []
    raw: list[str] = []
    bar = tqdm(total=len(examples), desc="own answers", unit="prompt", disable=not progress, leave=False)
    try:
        for start in range(0, len(examples), batch):
            chunk = examples[start:start + batch]
            prompts = [policy.chat.first_message(ex.text + DIRECT_SUFFIX, ex.images) for ex in chunk]
            gens = policy.generate(prompts, [ex.images for ex in chunk], max_new_tokens=DIRECT_TOKENS, greedy=True)
            for gen in gens:
                text = policy.reply_text(gen.token_ids)
                raw.append(text)
                span = answer_span(text)
                reply = None
                if span is not None:
                    try:  # a task may refuse to format what is not one of its actions
                        reply = task.format_reply(span)
                        action, error = task.parse_action(reply)
                    except (ValueError, TypeError, KeyError):
                        action, error = None, "refused"
                    if action is None or error:
                        reply = None
                wrapped.append(reply)
            bar.update(len(chunk))
    finally:
        bar.close()
    return wrapped, raw
