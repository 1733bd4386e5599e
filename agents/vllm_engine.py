"""The vLLM sampling engine: :meth:`agents.policy.Policy.generate`'s contract on vLLM (text models).

This module runs inside the vLLM process (:mod:`agents.vllm_server`, started with the vLLM
environment's python; the trainer talks to it through :class:`agents.vllm_client.VLLMSampler`),
because vLLM pins its own torch. It imports vLLM only when an engine is built, and nothing of
the project but :mod:`agents.record`.

What makes its samples the project's sampling distribution (docs/design.md, "Sampling
distribution"), tested against ``Policy.token_logprobs`` on CPU (``make test-vllm``):

- ``logprobs_mode="processed_logprobs"``: the reported log-probs are those of the distribution
  sampled from, ``log_softmax(logits / T)``; vLLM's default (raw logits) is wrong whenever T != 1.
- ``generation_config="vllm"``, ``top_k=-1``, ``top_p=1``, no penalties: a checkpoint's own
  sampling settings never change the distribution; ``ignore_eos`` with the policy's EOS
  (``<|im_end|>``) as the one stop token, kept in the reply, as the project's sampler stops.
- one seed per prompt (drawn by the caller from its seeded RNG), so a collect is reproducible.
- weights are reloaded in place from a safetensors folder (:meth:`VLLMEngine.reload`), and the
  prefix cache is reset after every reload: cached KV computed with the old weights would
  otherwise be reused for prompts that share a prefix. On CPU builds the GEMMs of layers that
  keep their weight (a tied LM head) are repacked too (:func:`refresh_cpu_gemms`).

Greedy requests are argmax decoding; their log-probs are reported at T = 1 (vLLM applies no
temperature to greedy rows), so :meth:`VLLMEngine.generate` refuses ``greedy`` with T != 1.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

from agents.record import Generation

logger = logging.getLogger(__name__)


class VLLMEngine:
    """A ``vllm.LLM`` set up to sample the project's distribution, with in-place weight reloads."""

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "float32", max_model_len: int = 2048,
                 seed: int = 0, enforce_eager: bool = True, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float | None = None, **llm_kwargs: Any) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("the vLLM engine needs vllm: pip install 'freshper[vllm]' on GPU machines, or "
                              "make vllm-venv for the CPU build (docs/scaling.md)") from exc
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        kwargs = dict(model=str(model_path), dtype=dtype, max_model_len=int(max_model_len), seed=int(seed),
                      enforce_eager=bool(enforce_eager), enable_prefix_caching=bool(enable_prefix_caching),
                      logprobs_mode="processed_logprobs", generation_config="vllm")
        if self.on_cpu:
            # A prompt prefilled in chunks has its first sampled token discarded and its seeded
            # generator rewound, which CPU generators cannot do ("CPU Generator does not use
            # offset"): a seeded batch of more prompt tokens than one step's budget failed.
            kwargs["enable_chunked_prefill"] = False
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self.model_path = str(model_path)
        self.reloads = 0

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, greedy: bool,
                 eos_token_id: int, seeds: Sequence[int]) -> list[Generation]:
        """Sample one reply per prompt: ids (ending with EOS unless cut by ``max_new_tokens``)
        and ``log_softmax(logits / T)`` of each sampled id."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if greedy and temperature != 1.0:
            raise ValueError("vLLM reports greedy log-probs at T = 1; use greedy with temperature 1 or sample")
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        params = [SamplingParams(n=1, temperature=0.0 if greedy else float(temperature), top_k=-1, top_p=1.0,
                                 min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                 max_tokens=int(max_new_tokens), logprobs=0, seed=int(seed),
                                 stop_token_ids=[int(eos_token_id)], ignore_eos=True, detokenize=False,
                                 skip_special_tokens=False)
                  for seed in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts], params,
                                 use_tqdm=False)
        results = []
        for out in outs:
            comp = out.outputs[0]
            ids = [int(t) for t in comp.token_ids]
            lps = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs)]
            results.append(Generation(ids, lps, bool(ids) and ids[-1] == int(eos_token_id)))
        return results

    def reload(self, weights_path: str | os.PathLike) -> None:
        """Load the weights in ``weights_path`` (a ``save_pretrained`` folder) in place, then
        drop every cached prefix (its KV belongs to the old weights)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})
        if self.on_cpu:
            self.llm.apply_model(refresh_cpu_gemms)
        self.llm.reset_prefix_cache()
        self.reloads += 1


def refresh_cpu_gemms(model: Any) -> int:
    """Re-pack the CPU GEMMs of layers that keep their weight (embeddings and the LM head).

    vLLM's CPU build packs each linear layer's weight into a oneDNN handle when loading. An
    in-place reload repacks the layers it loads, but a tied LM head shares the embedding's
    weight without loading it, so its handle keeps the old weights (measured: the reloaded
    model's log-probs were off by up to 4 nats until this ran). Returns the layers repacked.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0 and weight.ndim == 2:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count
