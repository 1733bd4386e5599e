"""A model that plays one turn at a time, for ``python -m agents.play ID --model PATH``.

The player is stateless between turns (prompt = instructions + current observation, the
``window:0`` mode the tiny default trains with), so a human can take over for some turns and
hand back control without the model's context going out of sync. For a task whose board is
its whole state (``markov_state``) the prompt holds the board alone, as ``train.py`` trains it
(``agents.runner.default_env_kwargs``), while the human still reads the move feedback.
"""

from __future__ import annotations

import numpy as np
import torch

from agents.policy import Policy
from agents.runner import default_env_kwargs


class ModelPlayer:
    """Proposes replies for ``env_id`` with the model at ``model_path`` (None: the tiny default)."""

    def __init__(
        self, model_path: str | None, env_id: str, *, greedy: bool = True, temperature: float = 1.0,
        max_new_tokens: int = 32, seed: int = 0,
    ) -> None:
        import envs  # noqa: F401
        from envs.registry import task_spec

        if not model_path:
            from agents.tiny import build_tiny_model

            model_path = str(build_tiny_model(task_spec(env_id).modality))
        self.policy = Policy.from_pretrained(model_path)
        self.board_only = default_env_kwargs(env_id, "window:0").get("feedback") is False
        self.env_id = env_id
        self.greedy = greedy
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.instructions = ""
        self._first = True
        torch.manual_seed(seed)

    def reset(self, obs: dict, info: dict) -> None:
        """Start an episode: remember the instructions (the first observation already has them)."""
        self.instructions = info.get("instructions", "")
        self._first = True

    def act(self, obs: dict, state_text: str | None = None) -> str:
        """The model's reply to the current observation; ``state_text`` (the env's
        ``state_text()``) replaces the observation text after the first turn of a board task."""
        seen = state_text if self.board_only and state_text is not None else obs["text"]
        text = obs["text"] if self._first or not self.instructions else f"{self.instructions}\n\n{seen}"
        self._first = False
        images = [np.asarray(obs["image"], dtype=np.uint8)] if self.policy.is_vision and "image" in obs else []
        prompt = self.policy.chat.first_message(text, images)
        gen = self.policy.generate([prompt], [images], max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, greedy=self.greedy)[0]
        return self.policy.reply_text(gen.token_ids)
