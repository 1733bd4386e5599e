"""The vLLM sampling engine: :meth:`agents.policies.policy.Policy.generate`'s contract on vLLM, text and
Qwen2-VL / Qwen2.5-VL images, with weights taken in memory from the trainer.

This module runs inside the vLLM process (:mod:`agents.engines.vllm_server`, started with the vLLM
environment's python; the trainer talks to it through :class:`agents.engines.vllm_client.VLLMSampler`),
because vLLM pins its own torch. It imports vLLM only when an engine is built, and nothing of
the project but :mod:`agents.record`. :class:`WeightSyncWorker` is imported by vLLM's workers
(``worker_extension_cls``), in whatever process they run.

What makes its samples the project's sampling distribution (docs/design.md#the-trajectory-record-agentsrecordpy,
"Sampling distribution"), tested against ``Policy.token_logprobs`` on CPU (``make test-vllm``):

- ``logprobs_mode="processed_logprobs"``: the reported log-probs are those of the distribution
  sampled from, ``log_softmax(logits / T)``; vLLM's default (raw logits) is wrong whenever T != 1.
- ``generation_config="vllm"``, ``top_k=-1``, ``top_p=1``, no penalties: a checkpoint's own
  sampling settings never change the distribution; ``ignore_eos`` with the policy's EOS
  (``<|im_end|>``) as the one stop token, kept in the reply, as the project's sampler stops.
- the vision special tokens the policy never samples (``Policy.suppressed_ids``) get a logit
  bias of -100 (vLLM's floor): their share of the softmax is below fp32 resolution, so the
  log-probs are those of the policy's distribution with them removed (without it they were off
  by log(1 + 4/516) = 0.0077 nats on the embedded VLM).
- one seed per prompt (drawn by the caller from its seeded RNG), so a collect is reproducible.

Images: a prompt holds each image as the renderer expands it (``<|image_pad|>`` once per visual
token); vLLM expands placeholders itself, so each run of pads goes in as one pad with the image
in ``multi_modal_data`` and vLLM's expansion is checked against the renderer's, token for token
(:meth:`VLLMEngine.generate` raises on any difference). The caller sends images already sized
as the policy's processor sizes them, so vLLM's processor leaves their size as it is. A model
whose config says ``freshper_positions: flat`` (the embedded VLM) gets 1-D rotary positions in
vLLM too (:meth:`WeightSyncWorker.freshper_flat_positions`).

Weights: :class:`WeightSyncWorker` joins a ``torch.distributed`` group with the trainer (a
TCPStore rendezvous and gloo on CPUs, NCCL on GPUs, built with plain torch on both sides, so
the trainer needs no vLLM) and receives the weights as broadcast buckets of tensors (or, with
the trainer on the same GPU, opens the trainer's buckets through CUDA IPC handles), loaded with
the model's own ``load_weights`` through vLLM's in-place reload (which repacks CPU GEMMs and
resets the encoder and multi-modal caches); then the prefix cache is reset (KV computed with
the old weights must not be reused). LoRA adapters go the same way into vLLM's LoRA manager
(:meth:`WeightSyncWorker.freshper_receive_adapter`), never through a file.
:meth:`VLLMEngine.reload` keeps the file round trip (a ``save_pretrained`` folder), which the
benchmark compares against.

Greedy requests are argmax decoding; their log-probs are reported at T = 1 (vLLM applies no
temperature to greedy rows), so :meth:`VLLMEngine.generate` refuses ``greedy`` with T != 1.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Sequence

from agents.record import Generation

logger = logging.getLogger(__name__)

#: vLLM clamps logit biases to [-100, 100]; e^-100 of the softmax mass is below fp32 resolution.
SUPPRESS_BIAS = -100.0
#: The in-memory LoRA adapter's name in vLLM (one adapter at a time, a new id per update).
ADAPTER_NAME = "freshper"
#: ``lora_path`` of in-memory adapters: vLLM requires a non-empty path; nothing reads it.
IN_MEMORY_ADAPTER_PATH = "/freshper/in-memory-adapter"


def collapse_image_pads(ids: Sequence[int], image_token_id: int | None) -> list[int]:
    """``ids`` with every run of image pads reduced to one (the form vLLM expands itself)."""
    out: list[int] = []
    for t in ids:
        t = int(t)
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


class VLLMEngine:
    """A ``vllm.LLM`` set up to sample the project's distribution, with weights taken in memory."""

    def __init__(self, model_path: str | os.PathLike, *, dtype: str = "auto", max_model_len: int = 2048,
                 seed: int = 0, enforce_eager: bool | None = None, enable_prefix_caching: bool = True,
                 gpu_memory_utilization: float | None = None, max_images: int = 16, lora_rank: int = 0,
                 sleep_mode: bool = False, **llm_kwargs: Any) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError("the vLLM engine needs vllm: pip install 'freshper[vllm]' on GPU machines, or "
                              "make vllm-venv for the CPU build (docs/scaling.md)") from exc
        from transformers import AutoConfig
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        if sleep_mode and self.on_cpu:
            raise ValueError("colocated mode needs vLLM's sleep mode, which the CPU build does not have "
                             "(its workers ignore sleep/wake_up): run it on a CUDA GPU (docs/scaling.md)")
        if dtype == "auto":  # bf16 on GPUs; fp32 on CPUs, where the learner's log-probs are fp32 too
            dtype = "float32" if self.on_cpu else "bfloat16"
        if enforce_eager is None:  # CUDA graphs on GPUs; the CPU build runs eagerly
            enforce_eager = self.on_cpu
        from agents.pretrained import resolve_model

        model_path = resolve_model(model_path)  # a short name or a .gguf: its converted folder
        config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=False)
        self.is_vision = getattr(config, "vision_config", None) is not None
        self.image_token_id: int | None = getattr(config, "image_token_id", None) if self.is_vision else None
        self.flat_positions = getattr(config, "freshper_positions", None) == "flat"
        kwargs = dict(model=str(model_path), dtype=dtype, max_model_len=int(max_model_len), seed=int(seed),
                      enforce_eager=bool(enforce_eager), enable_prefix_caching=bool(enable_prefix_caching),
                      logprobs_mode="processed_logprobs", generation_config="vllm",
                      worker_extension_cls="agents.engines.vllm_engine.WeightSyncWorker")
        if self.is_vision:
            kwargs["limit_mm_per_prompt"] = {"image": int(max_images), "video": 0}
        if lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=_vllm_lora_rank(lora_rank), max_loras=1)
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
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
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")
        self.enforce_eager = bool(enforce_eager)
        self.lora_rank = int(lora_rank)
        self.adapter_id = 0  # the served adapter's id (0: none yet)
        self.sleeping = False
        self.reloads = 0
        self.syncs = 0
        self.group_joined = False
        if self.flat_positions:
            self.llm.collective_rpc("freshper_flat_positions")

    # -- generation ----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, greedy: bool,
                 eos_token_id: int, seeds: Sequence[int], images: Sequence[Sequence[Any]] | None = None,
                 suppressed_ids: Sequence[int] = ()) -> list[Generation]:
        """Sample one reply per prompt: ids (ending with EOS unless cut by ``max_new_tokens``)
        and ``log_softmax(logits / T)`` of each sampled id. ``images[b]`` are prompt b's images
        (PIL images or uint8 arrays, in order), its image pads expanded as the policy renders them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if greedy and temperature != 1.0:
            raise ValueError("vLLM reports greedy log-probs at T = 1; use greedy with temperature 1 or sample")
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if self.sleeping:
            raise RuntimeError("the engine is asleep (colocated mode): wake it before generating")
        bias = {int(t): SUPPRESS_BIAS for t in suppressed_ids} or None
        params = [SamplingParams(n=1, temperature=0.0 if greedy else float(temperature), top_k=-1, top_p=1.0,
                                 min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                                 max_tokens=int(max_new_tokens), logprobs=0, seed=int(seed),
                                 stop_token_ids=[int(eos_token_id)], ignore_eos=True, detokenize=False,
                                 skip_special_tokens=False, logit_bias=bias)
                  for seed in seeds]
        inputs = []
        for b, prompt in enumerate(prompts):
            ims = list(images[b]) if images is not None else []
            if ims:
                if not self.is_vision:
                    raise ValueError("images given to a text model")
                inputs.append(TokensPrompt(prompt_token_ids=collapse_image_pads(prompt, self.image_token_id),
                                           multi_modal_data={"image": [_pil(im) for im in ims]}))
            else:
                inputs.append(TokensPrompt(prompt_token_ids=[int(t) for t in prompt]))
        lora = self._lora_request()
        outs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
        #: The prompts vLLM ran, token for token (image pads as vLLM expanded them).
        self.last_prompt_ids = [[int(t) for t in out.prompt_token_ids] for out in outs]
        results = []
        for b, out in enumerate(outs):
            if images is not None and images[b]:
                _check_expansion(prompts[b], out.prompt_token_ids, b, self.image_token_id)
            comp = out.outputs[0]
            ids = [int(t) for t in comp.token_ids]
            lps = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs)]
            results.append(Generation(ids, lps, bool(ids) and ids[-1] == int(eos_token_id)))
        return results

    def _lora_request(self):
        if not self.adapter_id:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(ADAPTER_NAME, self.adapter_id, IN_MEMORY_ADAPTER_PATH)

    # -- weights ---------------------------------------------------------------------------
    def join_weight_group(self, host: str, port: int, world_size: int, rank: int, backend: str,
                          timeout_s: float = 600.0) -> None:
        """Join the trainer's weight group (the trainer is rank 0 and hosts the store)."""
        self.llm.collective_rpc("freshper_join_group", kwargs=dict(host=host, port=int(port),
                                                                   world_size=int(world_size), rank=int(rank),
                                                                   backend=backend, timeout_s=float(timeout_s)))
        self.group_joined = True

    def receive_weights(self, buckets: list[list[list[Any]]]) -> None:
        """Take the weights the trainer broadcasts now (``buckets``: per bucket, its tensors'
        ``[name, dtype, shape]``), then drop every cached prefix (its KV is the old weights')."""
        if not self.group_joined:
            raise RuntimeError("no weight group: join_weight_group first")
        self.llm.collective_rpc("freshper_receive_weights", kwargs={"buckets": buckets})
        if self.on_cpu:
            self.llm.apply_model(refresh_cpu_gemms)
        self.llm.reset_prefix_cache()
        self.syncs += 1

    def receive_weights_ipc(self, buckets: list[list[list[Any]]], handles: list[str]) -> None:
        """Take the weights from the trainer's CUDA buckets (colocated mode: CUDA IPC handles)."""
        self.llm.collective_rpc("freshper_receive_weights_ipc", kwargs={"buckets": buckets, "handles": handles})
        self.llm.reset_prefix_cache()
        self.syncs += 1

    def receive_adapter(self, buckets: list[list[list[Any]]], peft_config: dict[str, Any]) -> int:
        """Take LoRA adapter tensors broadcast now and serve them (as a new adapter id, the old
        one removed); returns the id."""
        if not self.lora_rank:
            raise RuntimeError("this engine serves no LoRA adapters (start it with lora_rank)")
        if not self.group_joined:
            raise RuntimeError("no weight group: join_weight_group first")
        new_id = self.adapter_id + 1
        self.llm.collective_rpc("freshper_receive_adapter", kwargs={"buckets": buckets, "peft_config": peft_config,
                                                                     "adapter_id": new_id,
                                                                     "old_id": self.adapter_id})
        self.adapter_id = new_id
        self.llm.reset_prefix_cache()
        self.syncs += 1
        return new_id

    def reload(self, weights_path: str | os.PathLike) -> None:
        """Load the weights in ``weights_path`` (a ``save_pretrained`` folder) in place, then
        drop every cached prefix (its KV belongs to the old weights)."""
        import time

        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_path)})
        logger.info("reloaded the weights from %s in %.2f s", weights_path, time.perf_counter() - t0)
        if self.on_cpu:
            self.llm.apply_model(refresh_cpu_gemms)
        self.llm.reset_prefix_cache()
        self.reloads += 1

    # -- colocated mode --------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's GPU memory while the learner updates (weights offloaded to host
        memory, KV cache discarded): vLLM's sleep mode, level 1."""
        if not self.sleeping:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the GPU memory back (``tags``: ``["weights"]`` first, to load new weights into
        before the KV cache is allocated; None: everything)."""
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.sleeping = False


def _vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts for ``max_lora_rank`` that holds ``rank``."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest (512)")


def _pil(image: Any):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    import numpy as np

    return Image.fromarray(np.asarray(image, dtype=np.uint8), mode="RGB")


def _check_expansion(want: Sequence[int], got: Sequence[int], row: int, image_token_id: int | None) -> None:
    """The prompt vLLM ran must be the renderer's, image pads included, token for token."""
    want = [int(t) for t in want]
    got = [int(t) for t in got]
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    raise ValueError(f"vLLM's prompt for row {row} differs from the renderer's at token {first}: vLLM expanded the "
                     f"images to {got.count(image_token_id)} image pads ({len(got)} tokens), the policy's processor to "
                     f"{want.count(image_token_id)} ({len(want)} tokens). The two processors size the images "
                     "differently: check the model folder's preprocessor config (min_pixels/max_pixels)")


def refresh_cpu_gemms(model: Any) -> int:
    """Re-pack the CPU GEMM of a tied LM head after an in-place reload.

    vLLM's CPU build packs each linear layer's weight into a oneDNN handle when loading. An
    in-place reload repacks the layers it loads, but a tied LM head shares the embedding's
    weight without loading it, so its handle keeps the old weights (measured: the reloaded
    model's log-probs were off by up to 4 nats until this ran). Only LM heads are repacked
    (repacking every layer again cost as much as the reload). Returns the layers repacked.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (name.endswith("lm_head") and hasattr(module, "cpu_linear") and weight is not None
                and weight.numel() > 0 and weight.ndim == 2):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            count += 1
    return count


# -- inside vLLM's workers ------------------------------------------------------------------------
#: Bytes each tensor's start is aligned to inside a bucket (any dtype's view of it is aligned).
BUCKET_ALIGN = 64


def bucket_layout(entries: Sequence[Sequence[Any]]) -> tuple[list[int], int]:
    """Byte offsets of ``entries`` (``[name, dtype, shape]``) packed in one bucket, and its size."""
    import math

    import torch

    offsets, size = [], 0
    for _name, dtype, shape in entries:
        size = (size + BUCKET_ALIGN - 1) // BUCKET_ALIGN * BUCKET_ALIGN
        offsets.append(size)
        size += math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return offsets, size


def new_group(host: str, port: int, world_size: int, rank: int, backend: str, timeout_s: float, device: Any):
    """A two-sided ``torch.distributed`` group without the default process group (the trainer
    may have its own, e.g. FSDP's): a TCPStore rendezvous, then gloo or NCCL."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), int(world_size), rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore("freshper-weights", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        import torch

        opts = dist.ProcessGroupNCCL.Options()
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        torch.cuda.set_device(device)
    else:
        raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
    return store, group


def broadcast(group: Any, tensor: Any, wait: bool = True) -> Any:
    """Rank 0's ``tensor`` into every rank's (in place); with ``wait=False`` the pending work
    (``.wait()`` it before touching ``tensor``)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([tensor], opts)
    if wait:
        work.wait()
    return work


class WeightSyncWorker:
    """Methods mixed into vLLM's workers (``worker_extension_cls``), called through
    ``LLM.collective_rpc``: join the trainer's weight group, receive weights and adapters."""

    def freshper_join_group(self, host: str, port: int, world_size: int, rank: int, backend: str,
                            timeout_s: float) -> None:
        device = getattr(self, "device", None)
        self._freshper_store, self._freshper_group = new_group(host, port, world_size, rank, backend, timeout_s,
                                                               device)
        self._freshper_device = "cpu" if backend == "gloo" else device

    def _freshper_tensors(self, buckets: list[list[list[Any]]]):
        """(name, tensor) of each broadcast bucket in turn; the next bucket's receive is posted
        before this one's tensors are loaded, so receiving overlaps loading. A fresh buffer per
        bucket (the loader may hold a layer's tensors until the layer is complete)."""
        import torch

        def post(entries):
            offsets, size = bucket_layout(entries)
            flat = torch.empty(size, dtype=torch.uint8, device=self._freshper_device)
            return flat, offsets, broadcast(self._freshper_group, flat, wait=False)

        pending = post(buckets[0]) if buckets else None
        for i, entries in enumerate(buckets):
            flat, offsets, work = pending
            work.wait()
            pending = post(buckets[i + 1]) if i + 1 < len(buckets) else None
            for (name, dtype, shape), start in zip(entries, offsets):
                dt = getattr(torch, dtype)
                n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
                yield name, flat[start:start + n].view(dt).view(shape)

    def freshper_receive_weights(self, buckets: list[list[list[Any]]]) -> int:
        import time

        count, waited = 0, 0.0

        def counted():
            nonlocal count, waited
            tensors = self._freshper_tensors(buckets)
            while True:
                t0 = time.perf_counter()
                item = next(tensors, None)
                waited += time.perf_counter() - t0
                if item is None:
                    return
                count += 1
                yield item

        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
        logger.info("took %d tensors in %d buckets in memory in %.2f s (%.2f s of it receiving)", count, len(buckets),
                    time.perf_counter() - t0, waited)
        return count

    def freshper_receive_weights_ipc(self, buckets: list[list[list[Any]]], handles: list[str]) -> int:
        """The same as :meth:`freshper_receive_weights` for a trainer on this GPU (colocated
        mode): each bucket is the trainer's CUDA tensor, opened through its CUDA IPC handle
        (``torch.multiprocessing``'s reduction, pickled) instead of broadcast."""
        import base64
        import pickle

        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        count = 0

        def tensors():
            nonlocal count
            for entries, handle in zip(buckets, handles):
                flat = rebuild_cuda_tensor(*pickle.loads(base64.b64decode(handle)))
                offsets, _ = bucket_layout(entries)
                for (name, dtype, shape), start in zip(entries, offsets):
                    dt = getattr(torch, dtype)
                    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
                    count += 1
                    yield name, flat[start:start + n].view(dt).view(shape)

        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        torch.cuda.synchronize()
        return count

    def freshper_receive_adapter(self, buckets: list[list[list[Any]]], peft_config: dict[str, Any],
                                 adapter_id: int, old_id: int) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        tensors = {name: t.clone() for name, t in self._freshper_tensors(buckets)}
        runner = self.model_runner
        manager = runner.lora_manager
        adapters = manager._adapter_manager
        model = adapters.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        helper = PEFTHelper.from_dict(dict(peft_config))
        helper.validate_legal(manager.lora_config)
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=adapter_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        if old_id and old_id in manager.list_adapters():
            manager.remove_adapter(old_id)
        adapters.add_adapter(lora)

    def freshper_flat_positions(self) -> str:
        """Give the model 1-D rotary positions (``freshper_positions: flat``): every token at its
        index, as :func:`agents.policies.policy.flat_rope_index` does for the learner."""
        import torch

        model = self.model_runner.get_model()

        def flat_positions(self, input_tokens, mm_features):
            n = len(input_tokens)
            return torch.arange(n).unsqueeze(0).expand(3, n).contiguous(), 0

        if not hasattr(type(model), "get_mrope_input_positions"):
            raise ValueError(f"freshper_positions: flat needs a multimodal-rope model, got {type(model).__name__}")
        type(model).get_mrope_input_positions = flat_positions
        return type(model).__name__

    def freshper_leave_group(self) -> None:
        group = getattr(self, "_freshper_group", None)
        if group is not None and hasattr(group, "shutdown"):
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        self._freshper_group = None
