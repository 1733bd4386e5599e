"""Chat-template rendering of one new message, as token ids (no re-tokenization of history).

An episode's token sequence grows by appending: the ids the model sampled (ending with its
``<|im_end|>``), then the rendering of *only the next user message* — exactly the characters
the model's chat template would put between that ``<|im_end|>`` and the next assistant turn's
first token. This module finds those characters from the template itself (by rendering a
sentinel conversation and taking differences), so any Qwen-style template works, and caches
the pieces so a turn costs one tokenizer call instead of a Jinja render.

Images (``<image>`` in observation text) become image content items, rendered by the template
as ``<|vision_start|><|image_pad|><|vision_end|>``; the pad is then repeated once per visual
token, as the processor would, so ``token_ids`` hold the expanded form the model consumes.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np

from envs.base import IMAGE_PLACEHOLDER


class RenderingModel(Protocol):
    """What rendering needs of a policy (:class:`agents.policies.policy.Policy` is one)."""

    tokenizer: Any
    processor: Any  # None for text models
    name: str
    eos_token_id: int
    is_vision: bool

    def prepare_image(self, image: np.ndarray) -> Any:
        """The image as the processor sees it."""

logger = logging.getLogger(__name__)

_SENT = "QZXQSENTINELQZXQ"
_SENT2 = "QZXQSECONDQZXQ"
_MAX_CACHED_MESSAGES = 4096


#: The file of a model folder holding freshper's chat settings (``{"system_prompt": ...}``).
CHAT_SETTINGS = "freshper_chat.json"


def read_system_prompt(folder: str | os.PathLike) -> str | None:
    """The system prompt a model folder was saved with (:data:`CHAT_SETTINGS`), or None."""
    path = Path(str(folder)) / CHAT_SETTINGS
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("system_prompt")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path} is not a JSON object of chat settings: {exc}") from None
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: system_prompt must be a string, got {type(value).__name__}")
    return value


def write_system_prompt(folder: Path, text: str | None) -> Path:
    path = Path(folder) / CHAT_SETTINGS
    if text is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(json.dumps({"system_prompt": text}) + "\n", encoding="utf-8")
    return Path(folder)


class ChatRenderer:
    """Renders user messages to ids for one policy (tokenizer, template, image processor)."""

    def __init__(self, policy: RenderingModel, system_prompt: str | None = None) -> None:
        self.policy = policy
        #: A system message rendered before each conversation's first user message (None: the
        #: template's own default, where it has one).
        self.system_prompt = system_prompt
        self.tokenizer = policy.tokenizer
        owner = policy.processor if policy.processor is not None else policy.tokenizer
        if getattr(owner, "chat_template", None) is None and getattr(self.tokenizer, "chat_template", None):
            owner = self.tokenizer
        if getattr(owner, "chat_template", None) is None:
            raise ValueError(f"{policy.name or 'model'} has no chat template; freshper needs one to render turns")
        self._owner = owner
        self.image_token = "<|image_pad|>"
        self._num_image_tokens: dict[tuple[int, int], int] = {}
        # Rendered message -> ids. Episodes of a group (and a window:0 episode that stands still)
        # render the same messages over and over; the tokenizer is deterministic, so this is exact.
        self._ids: dict[str, tuple[int, ...]] = {}
        eos = self.tokenizer.convert_ids_to_tokens(policy.eos_token_id)
        # First message: prefix + text + suffix (with the generation prompt).
        system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
        first = self._render(system + [self._user(_SENT)], True)
        if system_prompt is not None and (system_prompt not in first or len(first.split(_SENT)) != 2):
            raise ValueError(f"{policy.name or 'model'}'s chat template does not render a system message")
        self._first = first.split(_SENT)
        # Continuation after an assistant turn that the model closed with EOS.
        base_msgs = [self._user("A"), {"role": "assistant", "content": _SENT2}]
        base = self._render(base_msgs, False)
        full = self._render(base_msgs + [self._user(_SENT)], True)
        if not full.startswith(base):
            raise ValueError("chat template does not render a conversation as a prefix of its extension")
        tail = base[base.rindex(_SENT2) + len(_SENT2):]
        if not tail.startswith(eos):
            raise ValueError(f"chat template does not close assistant turns with {eos!r}: {tail!r}")
        self._next = (tail[len(eos):] + full[len(base):]).split(_SENT)
        self._image_str: str | None = None
        if policy.is_vision:
            both = self._render([self._user(_SENT, [None], _SENT2)], True)
            self._image_str = both[both.index(_SENT) + len(_SENT): both.index(_SENT2)]
            if self.image_token not in self._image_str:
                raise ValueError(f"chat template renders images without {self.image_token}: {self._image_str!r}")

    # -- template ------------------------------------------------------------------------
    def _user(self, *parts: Any) -> dict[str, Any]:
        """A user message from text parts and image slots (``[None]`` stands for one image)."""
        if not self.policy.is_vision:
            return {"role": "user", "content": "".join(p for p in parts if isinstance(p, str))}
        content = []
        for p in parts:
            if isinstance(p, str):
                content.append({"type": "text", "text": p})
            else:
                content.extend({"type": "image"} for _ in p)
        return {"role": "user", "content": content}

    def _render(self, messages: list[dict[str, Any]], gen: bool) -> str:
        return self._owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def _text(self, text: str, num_images: int) -> str:
        """Message body: ``<image>`` placeholders replaced by the template's image string."""
        if not self.policy.is_vision:
            return text
        pieces = text.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != num_images:
            raise ValueError(f"observation has {len(pieces) - 1} {IMAGE_PLACEHOLDER} placeholders but {num_images} images")
        return self._image_str.join(pieces)

    # -- ids ------------------------------------------------------------------------------
    def num_image_tokens(self, image: np.ndarray) -> int:
        """Visual tokens the model spends on ``image`` (cached per image size)."""
        key = tuple(np.asarray(image).shape[:2])
        if key not in self._num_image_tokens:
            out = self.policy.processor.image_processor(
                images=[self.policy.prepare_image(image)], return_tensors="np"
            )
            merge = getattr(self.policy.processor.image_processor, "merge_size", 2)
            self._num_image_tokens[key] = int(np.prod(out["image_grid_thw"][0])) // (merge * merge)
        return self._num_image_tokens[key]

    def _encode(self, rendered: str, images: Sequence[np.ndarray]) -> list[int]:
        if images:
            chunks = rendered.split(self.image_token)
            if len(chunks) - 1 != len(images):
                raise ValueError(f"rendered message holds {len(chunks) - 1} image tokens for {len(images)} images")
            rendered = chunks[0] + "".join(
                self.image_token * self.num_image_tokens(im) + chunk for im, chunk in zip(images, chunks[1:])
            )
        ids = self._ids.get(rendered)
        if ids is None:
            if len(self._ids) >= _MAX_CACHED_MESSAGES:
                self._ids.clear()
            ids = self._ids[rendered] = tuple(self.tokenizer.encode(rendered, add_special_tokens=False))
        return list(ids)

    def first_message(self, text: str, images: Sequence[np.ndarray] = ()) -> list[int]:
        """Ids of a conversation's first user message plus the assistant generation prompt."""
        return self._encode(self._text(text, len(images)).join(self._first), images)

    def next_message(self, text: str, images: Sequence[np.ndarray] = ()) -> list[int]:
        """Ids that follow a sampled EOS: the rest of the assistant turn's closing, the new user
        message and the next generation prompt."""
        return self._encode(self._text(text, len(images)).join(self._next), images)
