"""A model that plays one turn at a time, for ``python -m agents.play ID --model PATH`` and the
play page of ``python -m agents.view``.

The player is stateless between turns (prompt = instructions + current observation, the
``window:0`` mode the tiny default trains with), so a human can take over for some turns and
hand back control without the model's context going out of sync. For a task whose board is
its whole state (``markov_state``) the prompt holds the board alone, as ``train.py`` trains it
(``agents.rollout.runner.default_env_kwargs``), while the human still reads the move feedback.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agents.policies.policy import Policy
from agents.record import Generation
from agents.rollout.runner import default_env_kwargs


@dataclass
class Proposal:
    """The model's reply to one observation, with the prompt it saw (to record the turn)."""

    reply: str
    prompt_ids: list[int]
    images: list[np.ndarray]  # the images in the prompt, in order
    generation: Generation  # the sampled ids and their behaviour log-probs


class ModelPlayer:
    """Proposes replies for ``env_id`` with the model at ``model_path`` (None: the tiny default),
    loaded on ``device`` in ``dtype`` (``--dtype`` names; ``auto``: bf16 on a GPU, fp32 on the CPU).

    ``policy`` hands in an already loaded model instead (``model_path`` is then only a label).
    """

    def __init__(
        self, model_path: str | None, env_id: str, *, greedy: bool = True, temperature: float = 1.0,
        max_new_tokens: int = 32, seed: int = 0, policy: Policy | None = None, device: str = "cpu",
        dtype: str = "auto",
    ) -> None:
        import envs  # noqa: F401
        from envs.registry import task_spec

        if policy is None:
            if not model_path:
                from agents.policies.tiny import build_tiny_model

                model_path = str(build_tiny_model(task_spec(env_id).modality))
            policy = Policy.from_pretrained(model_path, device=device, dtype=dtype)
        self.policy = policy
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

    def prompt(self, obs: dict, state_text: str | None = None, *, first: bool) -> tuple[list[int], list[np.ndarray]]:
        """The prompt ids (and its images) the model sees for ``obs``; ``first``: the episode's
        first turn, whose observation already holds the instructions."""
        seen = state_text if self.board_only and state_text is not None else obs["text"]
        text = obs["text"] if first or not self.instructions else f"{self.instructions}\n\n{seen}"
        images = [np.asarray(obs["image"], dtype=np.uint8)] if self.policy.is_vision and "image" in obs else []
        return self.policy.chat.first_message(text, images), images

    def propose(self, obs: dict, state_text: str | None = None, *, first: bool | None = None) -> Proposal:
        """The model's reply to the current observation with its prompt and sampled tokens.

        ``state_text`` (the env's ``state_text()``) replaces the observation text after the
        first turn of a board task; ``first`` defaults to whether this player has not yet
        replied in the episode.
        """
        first = self._first if first is None else first
        self._first = False
        prompt, images = self.prompt(obs, state_text, first=first)
        gen = self.policy.generate([prompt], [images], max_new_tokens=self.max_new_tokens,
                                   temperature=self.temperature, greedy=self.greedy)[0]
        return Proposal(self.policy.reply_text(gen.token_ids), prompt, images, gen)

    def act(self, obs: dict, state_text: str | None = None) -> str:
        """The model's reply to the current observation (the ``envs.play`` player interface)."""
        return self.propose(obs, state_text).reply
