"""The policy: an HF causal LM or Qwen2-VL-family model with its tokenizer/processor.

One class serves the tiny embedded defaults and real checkpoints (Qwen2.5-0.5B-Instruct,
Qwen2.5-VL-3B-Instruct) loaded from a local folder. It does three things the runner and the
learner need, and keeps them consistent with each other:

- rendering: a chat message to token ids, *only the new message* (see :mod:`agents.policies.chat`), with
  images expanded to their pad tokens by the processor;
- sampling: one batched, KV-cached generation over left-padded prompts, returning the sampled
  ids and their log-probs ``log_softmax(logits / T)`` taken at sampling time (text models: the
  hand-written loop of :mod:`agents.policies.sampling`; Qwen2-VL / Qwen2.5-VL: the same loop with image
  inputs and multimodal rope, :mod:`agents.policies.sampling_vl`; other VLMs: HF ``generate``);
- scoring: :meth:`Policy.token_logprobs` recomputes those log-probs (differentiably) over
  right-padded records, so the learner's ratios start at exactly 1 for fresh data.

The sampling distribution is exactly ``softmax(logits / T)`` with the vision special tokens
removed (sampling ``<|image_pad|>`` in a reply would break the next forward pass of a VLM):
the model's own ``generation_config`` (top-k/top-p/repetition penalty of a Qwen checkpoint)
is replaced by a neutral one, and the same token mask is applied when scoring.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from agents.policies import sampling_vl
from agents.policies.chat import CHAT_SETTINGS, ChatRenderer, read_system_prompt, write_system_prompt
from agents.policies.precision import LARGE_MODEL_PARAMETERS
from agents.record import Generation, Sample
from agents.policies.sampling import TurnKVCache, sample_text

logger = logging.getLogger(__name__)

_VISION_SPECIALS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
#: Logits above this many elements are turned into fp32 log-probs in row chunks (64M elements:
#: 256 MB of fp32 at a time, ~430 rows of a 151k vocabulary); the embedded models never reach it.
LOGPROB_CHUNK_ELEMENTS = 1 << 26
#: Model types whose causal-LM forward is ``lm_head(decoder(...).last_hidden_state[kept])``, the
#: head a bias-free ``Linear``: the learner scores them through the fused head
#: (:meth:`Policy.scoring_forward`, :mod:`agents.policies.head`).
FUSED_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl"})


def configure_threads(num_threads: int | None = None, *, parameters: int = 0) -> int:
    """Set torch's intra-op threads; by default, on machines with <= 2 CPUs, 1 for a model of
    fewer than :data:`~agents.policies.precision.LARGE_MODEL_PARAMETERS` parameters
    (``parameters``; 0: not known yet) and every CPU for a larger one; else half the CPUs, at
    most 8.

    Measured on 2 cores (docs/performance_agents.md, docs/results/real_model.md): a 64-episode
    FrozenLake collection of the tiny model took 3.1 s with 1 thread and 28 s with 2 (spinning
    threads fighting the other processes for the cores), while SmolLM2-135M's sampler makes
    352 tokens/s with 2 threads against 207 with 1. CLIs and benchmarks call this once at
    start-up, and again with ``parameters`` once the model is loaded.
    """
    if num_threads is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cpus = os.cpu_count() or 1
        if cpus <= 2:
            num_threads = cpus if parameters >= LARGE_MODEL_PARAMETERS else 1
        else:
            num_threads = max(1, min(8, cpus // 2))
    torch.set_num_threads(num_threads)
    return num_threads


#: ``config.freshper_positions`` value that gives a Qwen2-VL-family model 1-D rotary positions:
#: every token, visual ones included, at its plain index among the row's real tokens (a text
#: model's layout) instead of Qwen2-VL's (t, h, w) layout, in which the offset from an answer
#: token to the visual token of a board cell changes with the cell's row and column. The vision
#: tower keeps its own 2-D positions. The embedded tiny VLM is built with it
#: (docs/results/vision.md#where-in-the-decoder); a checkpoint saved from it keeps the setting in
#: its config.
FLAT_POSITIONS = "flat"


def flat_rope_index(input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None = None,
                    image_grid_thw=None, video_grid_thw=None, attention_mask: torch.Tensor | None = None,
                    **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_rope_index`` of the flat layout: ([3, B, L] positions, [B, 1] deltas) in HF's
    convention (padding at position 1; a new token's position is its index + delta)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
    mask = mask.long()
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    deltas = pos.amax(dim=-1, keepdim=True) + 1 - mask.shape[-1]
    return pos.unsqueeze(0).expand(3, -1, -1).contiguous(), deltas


def apply_position_layout(model) -> None:
    """Give ``model`` the rotary position layout its config names (``freshper_positions``):
    ``"flat"`` replaces the model's ``get_rope_index``, which HF's forward, the KV-cache sampler
    and the learner's log-probs all take their positions from, so every path agrees."""
    layout = getattr(model.config, "freshper_positions", None)
    if layout in (None, "mrope"):
        return
    if layout != FLAT_POSITIONS:
        raise ValueError(f"freshper_positions must be 'flat' or 'mrope', got {layout!r}")
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "get_rope_index"):
        raise ValueError(f"freshper_positions={layout!r} needs a Qwen2-VL-family model (one with get_rope_index), "
                         f"got {type(model).__name__}")
    inner.get_rope_index = flat_rope_index


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device a ``--device`` setting names: ``auto`` is the first CUDA device where
    torch sees one, else the CPU; a device this torch cannot use is a clear error here, not a
    crash at the first tensor."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; "
                             "use --device cpu (or auto, which falls back to the CPU)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    elif device.type != "cpu":
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {name!r}")
    return device


class Policy:
    """A language or vision-language model plus tokenizer (and processor for VLMs)."""

    def __init__(self, model, tokenizer, processor=None, *, name: str = "",
                 compute_dtype: torch.dtype | None = None, system_prompt: str | None = None) -> None:
        from transformers import GenerationConfig

        self.model = model
        #: The dtype forward passes compute in (``torch.autocast`` when it differs from the
        #: weights'); default: the weights' own.
        self.compute_dtype: torch.dtype = compute_dtype or next(model.parameters()).dtype
        apply_position_layout(model)
        self.tokenizer = tokenizer
        self.processor = processor
        self.name = name
        #: The LoRA adapters on :attr:`model` (:func:`agents.policies.lora.add_lora`) and the base
        #: folder they adapt; None without adapters.
        self.lora: Any = None
        self.lora_base: str | None = None
        self.is_vision = processor is not None and getattr(processor, "image_processor", None) is not None
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.eos_token_id: int = int(tokenizer.convert_tokens_to_ids("<|im_end|>")
                                     if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id)
        self.pad_token_id: int = int(tokenizer.pad_token_id)
        vocab = tokenizer.get_vocab()
        self.suppressed_ids: list[int] = (
            sorted(vocab[t] for t in _VISION_SPECIALS if t in vocab) if self.is_vision else []
        )
        # A neutral generation config: a checkpoint's top-k/top-p/penalties must not silently
        # change the sampling distribution away from softmax(logits / T). The checkpoint's own
        # is kept and written back by save_pretrained (its sampling defaults, its EOS ids).
        self.base_generation_config = getattr(model, "generation_config", None)
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, bos_token_id=None
        )
        from agents.policies import attention

        attention.install(model)  # short queries on the CPU as plain matrix products
        import inspect

        forward_params = inspect.signature(model.forward).parameters
        self._wants_mm_types = "mm_token_type_ids" in forward_params
        #: The model's KV-cache keyword: ``cache`` in transformers >= 5.x, ``past_key_values`` before.
        self.cache_arg: str = "cache" if "cache" in forward_params else "past_key_values"
        #: Whether ``forward`` takes ``logits_to_keep`` (only some positions through the LM head).
        self.takes_logits_to_keep: bool = "logits_to_keep" in forward_params
        self._fusable_head = self._head_fuses(model)
        vocab_ids = tokenizer.get_vocab()
        self.image_token_id: int | None = vocab_ids.get("<|image_pad|>")
        self.video_token_id: int | None = vocab_ids.get("<|video_pad|>")
        self.chat = ChatRenderer(self, system_prompt)

    @property
    def system_prompt(self) -> str | None:
        """The system message before each episode's first user message (None: the chat
        template's own default). Saved with the model (:data:`CHAT_SETTINGS`), so a checkpoint is
        played, evaluated and served with the prompts it was trained on."""
        return self.chat.system_prompt

    def set_system_prompt(self, text: str | None) -> None:
        if text != self.chat.system_prompt:
            self.chat = ChatRenderer(self, text)

    # -- loading and saving ---------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32,
        compute_dtype: torch.dtype | str | None = None,
    ) -> "Policy":
        """Load a causal LM or a Qwen2-VL-family VLM with its tokenizer/processor.

        ``path`` is a local folder, a ``.gguf`` file or a known short name
        (:func:`agents.pretrained.resolve_model`: converted on first use), or a hub id where a hub is
        reachable. Vision models are
        recognised by their config (a ``vision_config``), text models load with
        ``AutoModelForCausalLM``. A folder holding LoRA adapters (``adapter_config.json``, as a
        LoRA run's checkpoints do) loads its base model and the adapters on it.

        ``dtype`` is the weights' dtype (a ``--dtype`` name or a torch dtype; ``auto`` is decided
        for ``device`` and the model's size), ``compute_dtype`` the one forward passes run in (default: ``dtype``):
        a trained policy keeps fp32 weights and computes in bf16 under autocast.
        """
        from agents.pretrained import resolve_model
        from agents.policies.precision import resolve_dtype

        path = resolve_model(path)
        device = resolve_device(device)
        parameters = None
        if any(isinstance(d, str) and d.lower() == "auto" for d in (dtype, compute_dtype)):
            from agents.pretrained import model_parameters

            parameters = model_parameters(path)
        dtype = resolve_dtype(dtype, device, parameters)
        compute_dtype = dtype if compute_dtype is None else resolve_dtype(compute_dtype, device, parameters)
        adapter = Path(str(path)) / "adapter_config.json"
        if adapter.is_file():
            from agents.policies.lora import load_adapter_policy

            return load_adapter_policy(cls, Path(str(path)), device=device, dtype=dtype, compute_dtype=compute_dtype)
        # Recent transformers swap layers for kernels fetched from the hub when a model loads on
        # a GPU: off unless asked for (USE_HUB_KERNELS=YES), so nothing is downloaded at run time
        # and the sampler and the learner run the same code.
        os.environ.setdefault("USE_HUB_KERNELS", "NO")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        path_str = str(path)
        if not Path(path_str).exists() and ("/" not in path_str or path_str.startswith((".", "/"))):
            raise FileNotFoundError(f"no model folder at {path_str!r} (and it is not a hub id)")
        config = AutoConfig.from_pretrained(path_str, trust_remote_code=False)  # never a folder's code, never a prompt
        if getattr(config, "vision_config", None) is not None:
            from transformers import AutoProcessor

            try:
                from transformers import AutoModelForImageTextToText as auto_vlm
            except ImportError:  # older transformers
                from transformers import AutoModelForVision2Seq as auto_vlm
            model = auto_vlm.from_pretrained(path_str, dtype=dtype, trust_remote_code=False)
            processor = AutoProcessor.from_pretrained(path_str, trust_remote_code=False)
            tokenizer = processor.tokenizer
        else:
            model = AutoModelForCausalLM.from_pretrained(path_str, dtype=dtype, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(path_str, trust_remote_code=False)
            processor = None
        model.to(device)
        model.eval()
        return cls(model, tokenizer, processor, name=path_str, compute_dtype=compute_dtype,
                   system_prompt=read_system_prompt(path_str))

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """Write model, tokenizer and processor so :meth:`from_pretrained` reloads them (a model
        with LoRA adapters writes the adapters alone, naming its base). The checkpoint's own
        generation config is written, not the neutral one sampling uses."""
        path = Path(path)
        from agents.policies.lora import has_lora, save_adapter

        if has_lora(self.model):
            return write_system_prompt(save_adapter(self, path), self.system_prompt)
        path.mkdir(parents=True, exist_ok=True)
        write_system_prompt(path, self.system_prompt)
        neutral = self.model.generation_config
        if self.base_generation_config is not None:
            self.model.generation_config = self.base_generation_config
        try:
            self.model.save_pretrained(path)
        finally:
            self.model.generation_config = neutral
        if self.processor is not None:
            self.processor.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self):
        """The context forward passes run in: autocast to :attr:`compute_dtype` where it differs
        from the weights' dtype (mixed precision), else nothing."""
        from agents.policies.precision import autocast

        weights = next(self.model.parameters()).dtype
        return autocast(self.device, self.compute_dtype if self.compute_dtype != weights else torch.float32)

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the model recomputes its layers' activations in the backward pass."""
        for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers >= 5.x, before
            if hasattr(type(self.model), name):
                return bool(getattr(self.model, name))
        return False

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder layer's activations in the backward pass (HF's
        non-reentrant checkpointing): activation memory falls from every layer's to one
        layer's at a time, for about one more forward pass of compute. The learner then scores
        without a KV cache, which a recomputed layer would write twice: in packed passes with a
        tree-shaped attention mask (:mod:`learner.packed`), each distinct prompt still once."""
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(self.model).__name__} does not support gradient checkpointing")
        kwargs = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if hasattr(self.model, "enable_input_require_grads"):
            self.model.enable_input_require_grads()  # frozen embeddings (LoRA) still pass a gradient on

    # -- text ----------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        """Token ids to text, special tokens kept (so a reply decodes to exactly what was sampled)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def reply_text(self, ids: Sequence[int]) -> str:
        """The reply a sampled sequence stands for: its text without the closing EOS."""
        ids = list(ids)
        if ids and ids[-1] == self.eos_token_id:
            ids = ids[:-1]
        return self.decode(ids)

    def encode_reply(self, text: str) -> list[int]:
        """Token ids of a scripted assistant reply, closed by EOS as a sampled one would be."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_token_id]

    # -- images --------------------------------------------------------------------------
    def prepare_image(self, image: np.ndarray):
        """A uint8 (H, W, 3) array as the PIL image the processor sees (qwen-vl-utils sizing)."""
        from PIL import Image

        pil = Image.fromarray(np.asarray(image, dtype=np.uint8), mode="RGB")
        try:
            from qwen_vl_utils import fetch_image

            patch = getattr(self.processor.image_processor, "patch_size", 14)
            return fetch_image({"image": pil}, image_patch_size=patch)
        except ImportError:
            return pil

    def vision_inputs(self, images: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        """``pixel_values`` and ``image_grid_thw`` for images in order (deterministic)."""
        if not images:
            return {}
        out = self.processor.image_processor(images=[self.prepare_image(im) for im in images], return_tensors="pt")
        dtype = next(self.model.parameters()).dtype
        return {
            "pixel_values": out["pixel_values"].to(self.device, dtype),
            "image_grid_thw": out["image_grid_thw"].to(self.device),
        }

    def token_types(self, ids: torch.Tensor) -> torch.Tensor:
        """Per token: 1 image pad, 2 video pad, 0 text (the multimodal rope's token types)."""
        types = torch.zeros_like(ids)
        if self.image_token_id is not None:
            types[ids == self.image_token_id] = 1
        if self.video_token_id is not None:
            types[ids == self.video_token_id] = 2
        return types

    def _mm_types(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``mm_token_type_ids`` for transformers versions whose VLM forward wants it."""
        if not (self.is_vision and self._wants_mm_types):
            return {}
        return {"mm_token_type_ids": self.token_types(ids)}

    # -- log-probs -----------------------------------------------------------------------
    def scaled_logits(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """``logits / T`` in fp32 with the suppressed (vision special) tokens at -inf: the
        sampling distribution is ``softmax`` of this, and every log-prob is taken from it."""
        logits = logits.float() / temperature  # a new tensor: masking it in place is safe for autograd
        if self.suppressed_ids:
            logits[..., self.suppressed_ids] = float("-inf")
        return logits

    def sampling_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """``log_softmax(logits / T)`` over the sampleable tokens; logits [..., V]."""
        return torch.log_softmax(self.scaled_logits(logits, temperature), dim=-1)

    def logprobs_of(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """``log_softmax(logits / T)[target]`` in fp32, differentiable; logits [..., V], targets [...].

        Suppressed targets (prompt image pads, never sampled) report 0, not -inf, so a mask of
        0 on them cannot turn into NaN. Logits larger than :data:`LOGPROB_CHUNK_ELEMENTS` are
        taken in row chunks, each recomputed in the backward pass, so the fp32 copy of a whole
        batch's logits over a real vocabulary (~150k) is never held at once.
        """
        if logits.numel() <= LOGPROB_CHUNK_ELEMENTS:
            return self._logprobs_of(logits, targets, temperature)
        shape = targets.shape
        flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        rows = max(1, LOGPROB_CHUNK_ELEMENTS // logits.shape[-1])
        parts = []
        for start in range(0, flat_targets.shape[0], rows):
            chunk, target = flat_logits[start:start + rows], flat_targets[start:start + rows]
            if torch.is_grad_enabled() and chunk.requires_grad:
                from torch.utils.checkpoint import checkpoint

                parts.append(checkpoint(self._logprobs_of, chunk, target, temperature, use_reentrant=False))
            else:
                parts.append(self._logprobs_of(chunk, target, temperature))
        return torch.cat(parts).reshape(shape)

    @staticmethod
    def _head_fuses(model) -> bool:
        """Whether the model's forward ends in its decoder's last hidden states through a
        bias-free ``Linear`` head and nothing else (:data:`FUSED_HEAD_TYPES`, no logit scaling or
        soft-capping, a decoder that takes the images of a VLM itself)."""
        import inspect

        config, decoder = model.config, getattr(model, "model", None)
        if getattr(config, "model_type", None) not in FUSED_HEAD_TYPES or decoder is None:
            return False
        if any(getattr(config, k, None) not in (None, 1.0) for k in ("logit_scale", "final_logit_softcapping")):
            return False
        takes = inspect.signature(decoder.forward).parameters
        return not hasattr(config, "vision_config") or "pixel_values" in takes

    @property
    def num_parameters(self) -> int:
        """The model's parameters, frozen ones (a LoRA policy's base) included."""
        return sum(p.numel() for p in self.model.parameters())

    @property
    def fused_head(self) -> bool:
        """Whether scoring runs the decoder and the fused head of :mod:`agents.policies.head`
        instead of the model's own forward and :meth:`logprobs_of` (same values and gradients).
        Not for a sharded model (its head's weight is a shard outside the model's forward) nor
        a head that adapters replaced."""
        head = self.model.get_output_embeddings()
        return (self._fusable_head and not getattr(self, "sharded", False) and type(head) is torch.nn.Linear
                and head.bias is None)

    def scoring_forward(self, **kwargs) -> tuple[torch.Tensor, Any]:
        """The model's forward for scoring, the same keywords (``logits_to_keep`` included):
        ``(features, output)``, ``output`` carrying the cache. The features at the kept positions
        are the last hidden states where the head is fused (:attr:`fused_head`), else the logits;
        :meth:`features_logprobs` turns either into log-probs."""
        if not self.fused_head:
            out = self.model(**kwargs)
            return out.logits, out
        keep = kwargs.pop("logits_to_keep", 0)
        out = self.model.model(**kwargs)
        hidden = out.last_hidden_state
        if isinstance(keep, torch.Tensor):
            hidden = hidden[:, keep]
        elif keep:
            hidden = hidden[:, -keep:]
        return hidden, out

    def features_logprobs(self, features: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """``log_softmax(logits / T)[target]`` in fp32 from :meth:`scoring_forward`'s features
        [..., H or V], targets [...]: :func:`agents.policies.head.head_logprobs` on hidden states,
        :meth:`logprobs_of` on logits."""
        if self.fused_head:
            from agents.policies.head import head_logprobs

            return head_logprobs(features, self.model.get_output_embeddings().weight, targets, temperature,
                                 self.suppressed_ids)
        return self.logprobs_of(features, targets, temperature)

    def _logprobs_of(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        scaled = self.scaled_logits(logits, temperature)
        out = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        if self.suppressed_ids:
            out = torch.where(torch.isfinite(out), out, torch.zeros_like(out))
        return out

    def token_logprobs(
        self,
        samples: Sequence[Sample],
        images: Sequence[Sequence[np.ndarray]] | None = None,
        *,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Log-probs [B, T_max] (right-padded) of each token given the ones before it.

        Entry 0 and padding are 0. Differentiable: the learner backpropagates through it.
        ``images[b]`` are sample b's images in order (``[Trajectory.images[i] for i in
        sample.image_ids]``); they are required for vision samples.
        """
        if not samples:
            return torch.zeros(0, 0, device=self.device)
        device = self.device
        lengths = [len(s.token_ids) for s in samples]
        t_max = max(lengths)
        ids = torch.full((len(samples), t_max), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(samples), t_max), dtype=torch.long)
        for b, s in enumerate(samples):
            ids[b, : lengths[b]] = torch.as_tensor(s.token_ids, dtype=torch.long)
            mask[b, : lengths[b]] = 1
        ids, mask = ids.to(device), mask.to(device)
        kwargs: dict = {}
        if self.is_vision:
            flat = [im for per in (images or [[] for _ in samples]) for im in per]
            n_needed = sum(len(s.image_ids) for s in samples)
            if len(flat) != n_needed:
                raise ValueError(f"samples reference {n_needed} images but {len(flat)} were given")
            kwargs = {**self.vision_inputs(flat), **self._mm_types(ids)}
        with self.autocast():
            features, _ = self.scoring_forward(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs)
            lp = self.features_logprobs(features[:, :-1], ids[:, 1:], temperature) * mask[:, 1:]
        return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)

    # -- sampling ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        images: Sequence[Sequence[np.ndarray]] | None = None,
        *,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        greedy: bool = False,
        turn_cache: TurnKVCache | None = None,
    ) -> list[Generation]:
        """One batched, KV-cached generation over left-padded prompts.

        Stops each row at ``<|im_end|>`` (kept) or ``max_new_tokens``. Log-probs are
        ``log_softmax(logits / temperature)`` of the chosen tokens, also when ``greedy``.
        ``turn_cache`` (text models; one per collect) lets a prompt that extends an earlier
        prompt + reply reuse its KV (full-context episodes); vision models ignore it.
        """
        if not prompts:
            return []
        if temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy=True for argmax decoding)")
        with self.autocast():
            if not self.is_vision:
                return sample_text(self, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                                   greedy=greedy, turn_cache=turn_cache)
            if sampling_vl.supports(self.model):
                return sampling_vl.sample_vision(self, prompts, images, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, greedy=greedy)
            return self._generate_hf(prompts, images, max_new_tokens=max_new_tokens, temperature=temperature,
                                     greedy=greedy)

    def _generate_hf(
        self,
        prompts: Sequence[Sequence[int]],
        images: Sequence[Sequence[np.ndarray]] | None,
        *,
        max_new_tokens: int,
        temperature: float,
        greedy: bool,
    ) -> list[Generation]:
        """HF ``generate`` (vision models: Qwen2-VL's image inputs and rope deltas stay HF's)."""
        from transformers import GenerationConfig

        device = self.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, p in enumerate(prompts):
            if len(p):
                ids[b, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
                mask[b, width - len(p):] = 1
        kwargs: dict = {}
        if self.is_vision:
            kwargs = {**self.vision_inputs([im for per in (images or []) for im in per]), **self._mm_types(ids)}
        config = GenerationConfig(
            do_sample=not greedy,
            temperature=float(temperature) if not greedy else None,
            top_k=0 if not greedy else None,
            top_p=1.0,
            min_p=None,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            max_new_tokens=int(max_new_tokens),
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            suppress_tokens=list(self.suppressed_ids) or None,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                **{k: v.to(device) for k, v in kwargs.items()},
            )
        finally:
            self.model.train(was_training)
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1)  # [B, S, V] raw (before processors)
        lps = self.logprobs_of(logits, new, temperature).cpu().tolist()
        new = new.cpu().tolist()
        results = []
        for row, lp in zip(new, lps):
            if self.eos_token_id in row:
                n = row.index(self.eos_token_id) + 1
                results.append(Generation(row[:n], lp[:n], True))
            else:
                results.append(Generation(row, lp, False))
        return results

