"""Optional vLLM sampling engine for GPU machines (``pip install 'freshper[vllm]'``).

UNTESTED: no GPU or vLLM is available where freshper is developed and tested, so this module is
a thin, honest sketch of the interface, not a verified engine. It mirrors
:meth:`agents.policy.Policy.generate` (prompt ids in, sampled ids + behaviour log-probs out)
and reloads weights from the learner's :class:`~agents.policy.Policy` after each update.

Caveats: vLLM returns log-probs of its own (possibly bf16, differently fused) forward pass, so
they match ``Policy.token_logprobs`` only approximately; the learner's IS ratio absorbs the
difference but the 1e-4 check of docs/design.md does not hold. Images are not wired up here.
"""

from __future__ import annotations

import logging
from typing import Sequence

from agents.policy import Policy
from agents.record import Generation

logger = logging.getLogger(__name__)


class VLLMEngine:
    """Samples with vLLM from the weights of a :class:`Policy` (text models)."""

    def __init__(self, model_path: str, *, gpu_memory_utilization: float = 0.5, **llm_kwargs) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(
                "the vLLM engine needs vllm (GPU only): pip install 'freshper[vllm]'; "
                "on CPU use agents.policy.Policy.generate"
            ) from exc
        self.llm = LLM(model=str(model_path), gpu_memory_utilization=gpu_memory_utilization,
                       enable_prefix_caching=True, **llm_kwargs)

    def generate(
        self, prompts: Sequence[Sequence[int]], images=None, *, max_new_tokens: int = 32,
        temperature: float = 1.0, greedy: bool = False, eos_token_id: int | None = None,
    ) -> list[Generation]:
        """Same contract as :meth:`Policy.generate` (images unsupported)."""
        from vllm import SamplingParams, TokensPrompt

        if images and any(images):
            raise NotImplementedError("VLLMEngine does not pass images yet; use Policy.generate")
        params = SamplingParams(
            temperature=0.0 if greedy else temperature, top_k=-1, top_p=1.0, max_tokens=max_new_tokens,
            logprobs=0, stop_token_ids=[eos_token_id] if eos_token_id is not None else None,
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params)
        results = []
        for out in outs:
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs)]
            results.append(Generation(ids, lps, eos_token_id is not None and bool(ids) and ids[-1] == eos_token_id))
        return results

    def load_weights(self, policy: Policy) -> None:
        """Copy the learner's current weights into the engine (after an optimizer step)."""
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(((name, p.detach()) for name, p in policy.model.state_dict().items()))
