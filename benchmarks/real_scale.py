"""Real-size models: peak memory and tokens/s of one GRPO update and one replay update per
feature combination, freshper's learner beside TRL's GRPOTrainer on the same model and batch.

    python benchmarks/real_scale.py                        # the CPU plan: the sizes 24 GB hold
    python benchmarks/real_scale.py --plan gpu --device cuda   # one 80 GB GPU (docs/performance_scale.md)
    python benchmarks/real_scale.py --models qwen2.5-0.5b --features bf16,bf16+ckpt --no-trl
    python benchmarks/real_scale.py --plan gpu --device cuda --sharded   # + the 2-process learner (2 GPUs)
    python -m benchmarks.real_scale --memory-table          # the same, as a module

Run it with the project installed (``make setup``); it imports the project as a user's code does.
Models are randomly initialised from the published configurations of Qwen2.5-0.5B-Instruct,
Qwen2.5-1.5B-Instruct and Qwen2.5-VL-3B-Instruct (the values are written below; nothing is
downloaded) and saved once under ``--cache`` with the embedded model's tokenizer, so both
frameworks load the same weights from the same folder. The batch is a multi-turn one of the kind
the runner records: ``--groups`` tasks x ``--group-size`` rollouts x ``--turns`` turns in
``window:0`` context, each sample a ``--prompt``-token prompt (a shared header, the group's
turn-1 prompt shared by its rollouts) and a ``--reply``-token reply; the VL model's prompts hold
one image each. TRL's rows are the same sequences (prompt left-padded, completion right-padded).

Per combination and framework, one process: an update that warms up (Adam's state allocated),
then the timed GRPO update (on-policy, KL to the reference, 0.04) and the timed replay update
(stored behaviour log-probs off the current policy, PER weights and ages; TRL: its
``old_per_token_logps`` path). Peak memory is the process's resident set sampled every 2 ms
during the update on the CPU, ``torch.cuda.max_memory_allocated`` on a GPU. tokens/s counts every
token of every sequence the update scores. Each row says which learner path freshper took
(``prefix``: the KV-cached shared-prefix passes; ``packed``: the same sharing in packed passes
without a cache, under gradient checkpointing; ``full``: one forward per sequence). A
combination that does not fit or fails is reported as such, not dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: Published configurations (config.json of each Instruct checkpoint), written out.
QWEN25_TEXT = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                   hidden_act="silu", attention_dropout=0.0, use_sliding_window=False, bos_token_id=151643,
                   eos_token_id=151645)
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(kind="text", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, **QWEN25_TEXT),
    "qwen2.5-1.5b": dict(kind="text", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, **QWEN25_TEXT),
    "qwen2.5-7b": dict(kind="text", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
                       **{**QWEN25_TEXT, "vocab_size": 152064}),
    "qwen2.5-vl-3b": dict(
        kind="vision",
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=128000, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
                  rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_chans=3, tokens_per_second=2),
    ),
}
FEATURES: dict[str, dict[str, Any]] = {
    "fp32": dict(dtype="fp32", ckpt=False, lora=0),
    "bf16": dict(dtype="bf16", ckpt=False, lora=0),
    "bf16+ckpt": dict(dtype="bf16", ckpt=True, lora=0),
    "bf16+lora": dict(dtype="bf16", ckpt=False, lora=16),
    "bf16+ckpt+lora": dict(dtype="bf16", ckpt=True, lora=16),
    "fp32+lora": dict(dtype="fp32", ckpt=False, lora=16),
}
#: What each plan measures (model -> feature combinations).
PLANS: dict[str, dict[str, list[str]]] = {
    "cpu": {"qwen2.5-0.5b": ["fp32", "bf16", "bf16+ckpt", "bf16+lora", "bf16+ckpt+lora"],
            "qwen2.5-1.5b": ["bf16+lora", "bf16+ckpt+lora"],
            "qwen2.5-vl-3b": ["bf16+ckpt+lora"]},
    "gpu": {"qwen2.5-0.5b": ["fp32", "bf16", "bf16+ckpt", "bf16+lora", "bf16+ckpt+lora"],
            "qwen2.5-1.5b": ["bf16", "bf16+ckpt", "bf16+ckpt+lora"],
            "qwen2.5-vl-3b": ["bf16+ckpt", "bf16+ckpt+lora", "bf16+lora"]},
}
KL = 0.04


# -- models and batches ------------------------------------------------------------------------
def model_folder(name: str, cache: Path) -> Path:
    """The randomly initialised model ``name`` saved with a tokenizer (built once, cached)."""
    folder = cache / name
    if (folder / "done").exists():
        return folder
    import torch
    from transformers import AutoTokenizer

    from agents.policies.tiny import build_tiny_model

    kind = CONFIGS[name]["kind"]
    tiny = build_tiny_model("text" if kind == "text" else "vision")
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model(name)
    if kind == "text":
        AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    else:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(tiny)
        ids = processor.tokenizer.convert_tokens_to_ids
        for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                           ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
            setattr(model.config, key, ids(token))  # the embedded tokenizer's ids for the vision tokens
        processor.save_pretrained(folder)
    model.to(torch.bfloat16).save_pretrained(folder)  # bf16 on disk: half the size; loaded in either dtype
    (folder / "done").write_text("ok")
    return folder


def make_records(policy, args: argparse.Namespace, seed: int = 0) -> list:
    """The benchmark batch as the runner records it (see the module docstring)."""
    import numpy as np

    from agents.record import Sample, Trajectory

    rng = np.random.default_rng(seed)
    vocab = int(policy.model.config.get_text_config().vocab_size)
    low = 1000  # ordinary tokens, clear of the special ids
    header = rng.integers(low, vocab, args.prompt // 3)
    images_per_prompt = 1 if policy.is_vision else 0
    records = []
    for g in range(args.groups):
        first_turn = rng.integers(low, vocab, args.prompt - len(header))
        for k in range(args.group_size):
            samples, images = [], []
            for t in range(args.turns):
                body = first_turn if t == 0 else rng.integers(low, vocab, args.prompt - len(header))
                prompt = np.concatenate([header, body])
                image_ids = []
                if images_per_prompt:
                    image = group_image(g, args, rng) if t == 0 else \
                        (rng.random((args.image, args.image, 3)) * 255).astype(np.uint8)
                    images.append(image)
                    image_ids = [len(images) - 1]
                    prompt = np.concatenate([prompt[:8], vision_span(policy, image), prompt[8:]])
                reply = rng.integers(low, vocab, args.reply)
                ids = np.concatenate([prompt, reply])
                mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(reply))]).astype(np.int8)
                lp = np.where(mask > 0, -rng.random(len(ids)) * 3.0, 0.0).astype(np.float32)
                samples.append(Sample(ids, mask, lp, image_ids=image_ids))
            records.append(Trajectory(env_id="bench", seed=g, group_id=g, turns=[], samples=samples,
                                      episode_return=float(rng.random()), success=False, policy_version=0,
                                      advantage=float(rng.normal()), images=images))
    return records


_FIRST_IMAGES: dict[int, Any] = {}


def group_image(group: int, args: argparse.Namespace, rng):
    """A group's turn-1 image, the same for all its rollouts (their prompts are identical)."""
    if group not in _FIRST_IMAGES:
        _FIRST_IMAGES[group] = (rng.random((args.image, args.image, 3)) * 255).astype("uint8")
    return _FIRST_IMAGES[group]


def vision_span(policy, image) -> Any:
    """The token ids an image takes in a prompt: vision start, its pads, vision end."""
    import numpy as np

    grid = policy.vision_inputs([image])["image_grid_thw"][0]
    merge = policy.model.config.vision_config.spatial_merge_size
    n = int(grid.prod()) // (merge * merge)
    ids = policy.tokenizer.convert_tokens_to_ids
    return np.array([ids("<|vision_start|>")] + [ids("<|image_pad|>")] * n + [ids("<|vision_end|>")])


def build_model(name: str):
    """Model ``name`` from its published config (random weights; ``meta`` device: no memory)."""
    import torch

    spec = dict(CONFIGS[name])
    kind = spec.pop("kind")
    if kind == "text":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        return Qwen2ForCausalLM(Qwen2Config(**spec))
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(spec["text"])
    scaling = text.pop("rope_scaling")
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               "mrope_section": scaling["mrope_section"]}
    del torch
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=spec["vision"]))


def parameter_counts(name: str, lora_rank: int = 16) -> tuple[int, int]:
    """(all parameters, LoRA adapter parameters at ``lora_rank`` on every projection of the
    language model): counted on a model built on the ``meta`` device."""
    import torch

    from agents.policies.lora import LoraSettings

    with torch.device("meta"):
        model = build_model(name)
    total = sum(p.numel() for p in model.parameters())
    pattern = __import__("re").compile(LoraSettings(rank=lora_rank).target_regex())
    adapters = sum(lora_rank * (m.in_features + m.out_features) for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and pattern.match(n))
    return total, adapters


#: Bytes per trained parameter that do not depend on the batch: fp32 weights, gradients and
#: Adam's two moments; a bf16 copy (the KL reference, a LoRA base, a sharded learner's sampler).
TRAINED_BYTES, BF16_BYTES = 16, 2


def static_memory(name: str, features: str, world: int = 1) -> float:
    """GiB per GPU (rank 0's, the largest) of a run's weights, gradients, Adam state, KL
    reference and sampler copy: what the learner holds whatever the batch (activations, logits
    and the KV cache come on top)."""
    total, adapters = parameter_counts(name)
    feat = FEATURES[features]
    if feat["lora"]:  # a bf16 base (frozen, sharded across ranks) + fp32 adapters; the reference is the base
        learner = (BF16_BYTES * total + TRAINED_BYTES * adapters) / world
    else:
        compute = 4 if feat["dtype"] == "fp32" else BF16_BYTES
        learner = TRAINED_BYTES * total / world + compute * total  # the reference: one copy per rank
    sampler = (BF16_BYTES * total + 4 * adapters) if world > 1 else 0.0  # rank 0's unsharded copy
    return (learner + sampler) / 2**30


MEMORY_ROWS = [("qwen2.5-0.5b", "fp32", 1), ("qwen2.5-0.5b", "bf16", 1), ("qwen2.5-0.5b", "bf16+lora", 1),
               ("qwen2.5-1.5b", "bf16", 1), ("qwen2.5-1.5b", "bf16+lora", 1),
               ("qwen2.5-vl-3b", "bf16", 1), ("qwen2.5-vl-3b", "bf16+lora", 1), ("qwen2.5-vl-3b", "bf16", 2),
               ("qwen2.5-7b", "bf16", 1), ("qwen2.5-7b", "bf16+lora", 1), ("qwen2.5-7b", "bf16", 8),
               ("qwen2.5-7b", "bf16+lora", 8)]


def memory_table() -> str:
    """The computed rows of the memory table (docs/performance_scale.md)."""
    lines = ["| model | parameters | training | GPUs | weights + grads + Adam + reference + sampler, GiB per GPU |",
             "|---|---:|---|---:|---:|"]
    for name, features, world in MEMORY_ROWS:
        total, _ = parameter_counts(name)
        feat = FEATURES[features]
        what = (f"LoRA r{feat['lora']}" if feat["lora"] else "full fine-tuning") + f", {feat['dtype']}"
        lines.append(f"| {name} | {total / 1e9:.2f}B | {what} | {world} | {static_memory(name, features, world):.1f} |")
    return "\n".join(lines)


# -- measuring ---------------------------------------------------------------------------------
class Peak:
    """Peak memory while a block runs: CUDA's allocator peak, or the resident set sampled every 2 ms."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __enter__(self) -> "Peak":
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.peak, self._stop = rss(), threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss())
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = time.process_time() - self.cpu0  # every thread of this process: less sensitive to load


def rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def seq_tokens(records: list) -> int:
    return sum(len(s.token_ids) for r in records for s in r.samples)


# -- freshper ----------------------------------------------------------------------------------
def run_freshper(folder: Path, feat: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from agents.policies.lora import LoraSettings, add_lora
    from agents.policies.policy import Policy
    from agents.policies.precision import resolve_dtype
    from learner.loss import LossSettings
    import learner.prefix
    from learner.update import AdapterReference, policy_update

    natural, forced = learner.prefix.scoring_path, getattr(args, "path", None)
    if forced:  # the trained model's scoring path (a frozen reference keeps its own)
        if forced == "prefix" and feat["ckpt"]:
            raise ValueError("the prefix path needs a KV cache: not under gradient checkpointing")
        learner.prefix.scoring_path = lambda p, samples=None: forced if p.model.training else natural(p, samples)
    compute = resolve_dtype(feat["dtype"], args.device)
    policy = Policy.from_pretrained(folder, device=args.device, dtype=compute if feat["lora"] else torch.float32,
                                    compute_dtype=compute)
    if feat["lora"]:
        add_lora(policy, LoraSettings(rank=feat["lora"]))
        ref = AdapterReference(policy)
    else:
        ref = Policy.from_pretrained(folder, device=args.device, dtype=compute)
        ref.model.requires_grad_(False)
    if feat["ckpt"]:
        policy.enable_gradient_checkpointing()
    opt = torch.optim.Adam([p for p in policy.model.parameters() if p.requires_grad], lr=1e-6)
    records = make_records(policy, args)
    n = len(records)
    loss_cfg = LossSettings(kl_coef=KL)

    def grpo():
        return policy_update(policy, ref, opt, None, records, np.ones(n), np.zeros(n), loss_cfg=loss_cfg,
                             on_policy=True, micro_batch=args.micro_batch)

    def replay():
        return policy_update(policy, ref, opt, None, records, np.linspace(0.5, 1.5, n), np.arange(n, dtype=float),
                             loss_cfg=loss_cfg, on_policy=False, micro_batch=args.micro_batch)

    if not args.no_warmup:
        grpo()
    out: dict[str, Any] = {}
    for kind, fn in (("grpo", grpo), ("replay", replay)):
        with Peak(args.device) as peak:
            stats = fn()
        out[kind] = {"seconds": peak.seconds, "cpu_seconds": peak.cpu_seconds, "peak_bytes": peak.peak,
                     "tokens": seq_tokens(records), "loss": stats.get("loss")}
    policy.model.train()
    out["path"] = learner.prefix.scoring_path(policy, [s for r in records for s in r.samples])
    return out


def run_sharded(folder: Path, feat: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """freshper's sharded learner on this ``torchrun`` rank (FSDP2): the same batch, each rank
    its part; rank 0's numbers are reported (its peak is the largest: no sampler copy here)."""
    import numpy as np
    import torch

    from agents.policies.lora import LoraSettings, add_lora
    from agents.policies.policy import Policy
    from agents.policies.precision import resolve_dtype
    from learner import distributed
    from learner.loss import LossSettings
    from learner.update import AdapterReference, policy_update

    device = distributed.init(args.device)
    compute = resolve_dtype(feat["dtype"], device)
    policy = Policy.from_pretrained(folder, device="cpu", dtype=compute if feat["lora"] else torch.float32,
                                    compute_dtype=compute)
    if feat["lora"]:
        add_lora(policy, LoraSettings(rank=feat["lora"]))
    if feat["ckpt"]:
        policy.enable_gradient_checkpointing()
    records = make_records(policy, args)
    distributed.shard_policy(policy, compute)
    if device.type == "cuda":
        policy.model.to(device)
    if feat["lora"]:
        ref = AdapterReference(policy)
    else:
        ref = Policy.from_pretrained(folder, device=device, dtype=compute)
        ref.model.requires_grad_(False)
    opt = torch.optim.Adam([p for p in policy.model.parameters() if p.requires_grad], lr=1e-6)
    n, shard, loss_cfg = len(records), distributed.Shard(distributed.rank(), distributed.world_size()), LossSettings(kl_coef=KL)

    def update(on_policy: bool):
        weights = np.ones(n) if on_policy else np.linspace(0.5, 1.5, n)
        ages = np.zeros(n) if on_policy else np.arange(n, dtype=float)
        return policy_update(policy, ref, opt, None, records, weights, ages, loss_cfg=loss_cfg, on_policy=on_policy,
                             micro_batch=args.micro_batch, shard=shard)

    if not args.no_warmup:
        update(True)
    out: dict[str, Any] = {"path": "full", "world_size": distributed.world_size()}
    for kind, on_policy in (("grpo", True), ("replay", False)):
        torch.distributed.barrier()
        with Peak(str(device)) as peak:
            stats = update(on_policy)
        out[kind] = {"seconds": peak.seconds, "cpu_seconds": peak.cpu_seconds, "peak_bytes": peak.peak,
                     "tokens": seq_tokens(records), "loss": stats.get("loss")}
    torch.distributed.destroy_process_group()
    return out


# -- TRL ---------------------------------------------------------------------------------------
def run_trl(folder: Path, feat: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoProcessor, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from agents.policies.policy import Policy

    vision = CONFIGS[folder.name]["kind"] == "vision"
    bf16 = feat["dtype"] == "bf16"
    peft_config = None
    if feat["lora"]:
        from peft import LoraConfig

        peft_config = LoraConfig(r=feat["lora"], lora_alpha=2 * feat["lora"], lora_dropout=0.0,
                                 target_modules=r"^(?!.*visual).*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$")
    n_rows = args.groups * args.group_size * args.turns
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=n_rows, gradient_accumulation_steps=1,
                            num_generations=args.group_size, generation_batch_size=n_rows,
                            max_completion_length=args.reply, beta=KL, loss_type="bnpo", learning_rate=1e-6,
                            bf16=bf16, use_cpu=args.device == "cpu", gradient_checkpointing=feat["ckpt"],
                            gradient_checkpointing_kwargs={"use_reentrant": False}, report_to=[], save_strategy="no",
                            logging_steps=1, model_init_kwargs={"use_kernels": False,
                                                                "dtype": torch.bfloat16 if feat["lora"] and bf16
                                                                else torch.float32})
        processing = AutoProcessor.from_pretrained(folder) if vision else AutoTokenizer.from_pretrained(folder)
        trainer = GRPOTrainer(model=str(folder), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=config, train_dataset=Dataset.from_dict({"prompt": ["x"] * n_rows}),
                              processing_class=processing, peft_config=peft_config)
        trainer.create_optimizer()
        trainer.current_gradient_accumulation_steps = 1  # what its training loop sets
        model, device = trainer.model, trainer.accelerator.device
        policy = Policy.from_pretrained(folder)  # for the batch's image tokens only
        records = make_records(policy, args)
        del policy
        rows = [(s, r) for r in records for s in r.samples]
        p_len = max(int(np.argmax(s.loss_mask > 0)) for s, _ in rows)
        c_len = args.reply
        pad = processing.pad_token_id if not vision else processing.tokenizer.pad_token_id
        prompt_ids = torch.full((len(rows), p_len), pad, dtype=torch.long)
        prompt_mask = torch.zeros((len(rows), p_len), dtype=torch.long)
        completion_ids = torch.full((len(rows), c_len), pad, dtype=torch.long)
        completion_mask = torch.zeros((len(rows), c_len), dtype=torch.long)
        old = torch.zeros((len(rows), c_len))
        for i, (s, _) in enumerate(rows):
            start = int(np.argmax(s.loss_mask > 0))
            prompt = torch.as_tensor(s.token_ids[:start])
            prompt_ids[i, p_len - len(prompt):] = prompt
            prompt_mask[i, p_len - len(prompt):] = 1
            reply = torch.as_tensor(s.token_ids[start:])
            completion_ids[i, :len(reply)] = reply
            completion_mask[i, :len(reply)] = 1
            old[i, :len(reply)] = torch.as_tensor(s.behavior_logprobs[start:])
        inputs: dict[str, Any] = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                                  "completion_mask": completion_mask,
                                  "advantages": torch.as_tensor([r.advantage for _, r in rows], dtype=torch.float32),
                                  "num_items_in_batch": completion_mask.sum()}
        if vision:
            vis = processing.image_processor(images=[r.images[s.image_ids[0]] for s, r in rows], return_tensors="pt")
            inputs.update(pixel_values=vis["pixel_values"], image_grid_thw=vis["image_grid_thw"],
                          num_images=[1] * len(rows))
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}

        def update(with_old: bool) -> float:
            model.train()
            batch = dict(inputs)
            input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            extra = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "num_images") if k in batch}
            with torch.no_grad():  # the reference's log-probs, as TRL takes them at generation time
                ref_model = trainer.ref_model
                if ref_model is None:  # PEFT: the adapters off
                    with trainer.accelerator.unwrap_model(model).disable_adapter():
                        ref, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, c_len, **extra)
                else:
                    ref, _, _ = trainer._get_per_token_logps_and_entropies(ref_model, input_ids, attention, c_len,
                                                                           **extra)
            batch["ref_per_token_logps"] = ref
            if with_old:
                batch["old_per_token_logps"] = old.to(device)
            with trainer.compute_loss_context_manager():
                loss = trainer.compute_loss(model, batch)
            trainer.accelerator.backward(loss)
            trainer.accelerator.clip_grad_norm_(model.parameters(), 1.0)
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
            return float(loss)

        if not args.no_warmup:
            update(False)
        out: dict[str, Any] = {}
        for kind, with_old in (("grpo", False), ("replay", True)):
            with Peak(args.device) as peak:
                loss = update(with_old)
            out[kind] = {"seconds": peak.seconds, "cpu_seconds": peak.cpu_seconds, "peak_bytes": peak.peak,
                         "tokens": seq_tokens(records), "loss": loss}
        out["path"] = "full"
        return out


# -- the driver --------------------------------------------------------------------------------
def worker(spec: dict[str, Any]) -> None:
    """One (model, features, framework) measurement in this process; prints one JSON line."""
    import torch

    args = argparse.Namespace(**spec["args"])
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    folder, feat = Path(spec["folder"]), FEATURES[spec["features"]]
    runner = {"freshper": run_freshper, "trl": run_trl, "freshper-2proc": run_sharded}[spec["framework"]]
    try:
        result = runner(folder, feat, args)
        result["status"] = "ok"
    except (torch.OutOfMemoryError, MemoryError):
        result = {"status": "out of memory"}
    except Exception as exc:  # noqa: BLE001 - reported in the table, the other combinations go on
        result = {"status": f"failed: {type(exc).__name__}: {str(exc)[:200]}"}
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(result), flush=True)
    elif spec["framework"] == "freshper-2proc":  # without finalization: the group's threads outlive it
        from learner.distributed import exit_serving_rank
        exit_serving_rank(0)


def measure(model: str, features: str, framework: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    spec = {"folder": str(folder), "features": features, "framework": framework, "args": vars(args)}
    # Idle OpenMP threads sleep, so a process's CPU time is the work it did, not spinning.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_WAIT_POLICY": "PASSIVE"}
    launcher = [sys.executable] if framework != "freshper-2proc" else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    try:
        proc = subprocess.run([*launcher, str(Path(__file__).resolve()), "--worker", json.dumps(spec)],
                              capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"over {args.timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
    killed = proc.returncode in (-9, 137)
    return {"status": "out of memory (killed)" if killed else f"failed (exit {proc.returncode}): {tail[0][:200]}"}


def gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def rate(r: dict[str, Any], clock: str) -> float:
    return r["tokens"] / max(r[clock], 1e-9)


def sharded_table(rows: list[dict[str, Any]], clock: str = "seconds") -> str:
    """The 2-process learner beside the 1-process one (rank 0's peak and the job's tokens/s)."""
    unit = "tokens/s" if clock == "seconds" else "tokens/CPU-s (rank 0)"
    lines = [f"| model | features | update | 1 process peak GiB | 1 process {unit} | 2 processes: rank 0 peak GiB | "
             f"2 processes {unit} |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        one, two = row["freshper"], row.get("freshper-2proc")
        if two is None:
            continue
        for kind in ("grpo", "replay"):
            cells = [row["model"], row["features"], kind]
            for res in (one, two):
                cells += ([gib(res[kind]["peak_bytes"]), f"{rate(res[kind], clock):.0f}"] if res.get("status") == "ok"
                          else [res.get("status", "?"), ""])
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows: list[dict[str, Any]], clock: str = "seconds") -> str:
    """Side by side; ``clock``: ``seconds`` (wall) or ``cpu_seconds`` (the process's CPU time,
    what a loaded machine distorts least)."""
    unit = "tokens/s" if clock == "seconds" else "tokens/CPU-s"
    lines = [f"| model | features | update | path | freshper peak GiB | freshper {unit} | TRL peak GiB | "
             f"TRL {unit} | {unit} ratio | memory ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        f, t = row["freshper"], row.get("trl") or {"status": "not run"}
        for kind in ("grpo", "replay"):
            cells = [row["model"], row["features"], kind, f.get("path", "")]
            for res in (f, t):
                if res.get("status") == "ok":
                    r = res[kind]
                    cells += [gib(r["peak_bytes"]), f"{rate(r, clock):.0f}"]
                else:
                    cells += [res.get("status", "?"), ""]
            if f.get("status") == "ok" and t.get("status") == "ok":
                a, b = f[kind], t[kind]
                cells += [f"{rate(a, clock) / rate(b, clock):.2f}", f"{a['peak_bytes'] / b['peak_bytes']:.2f}"]
            else:
                cells += ["", ""]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="cpu")
    parser.add_argument("--models", default=None, help="comma-separated subset of the plan's models")
    parser.add_argument("--features", default=None, help="comma-separated feature combinations (default: the plan's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=192, help="prompt tokens per turn (without image tokens)")
    parser.add_argument("--reply", type=int, default=32, help="reply tokens per turn")
    parser.add_argument("--image", type=int, default=224, help="image side in pixels (the VL model)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-trl", action="store_true", help="freshper alone")
    parser.add_argument("--path", choices=("prefix", "packed", "full"), default=None,
                        help="freshper's scoring path instead of its own choice (learner.prefix.scoring_path; "
                             "prefix: not with gradient checkpointing)")
    parser.add_argument("--no-warmup", action="store_true", help="time the first updates (large models on a CPU)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per measurement process")
    parser.add_argument("--cache", default=str(REPO / ".cache" / "real_scale"))
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.add_argument("--sharded", action="store_true",
                        help="also the sharded learner on 2 processes (torchrun; FSDP2, gloo on the CPU, NCCL on GPUs)")
    parser.add_argument("--memory-table", action="store_true", help="print the computed memory rows and exit")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.memory_table:
        print(memory_table())
        return 0
    plan = PLANS[args.plan]
    models = args.models.split(",") if args.models else list(plan)
    spec_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("worker", "out")})
    rows = []
    for model in models:
        if model not in CONFIGS:
            parser.error(f"unknown model {model!r}; one of {sorted(CONFIGS)}")
        print(f"building {model} (random weights from its published config) ...", flush=True)
        folder = model_folder(model, Path(args.cache))
        for features in (args.features.split(",") if args.features else plan[model]):
            row = {"model": model, "features": features}
            for framework in ("freshper",) + (() if args.no_trl else ("trl",)) + (("freshper-2proc",) if args.sharded else ()):
                t0 = time.perf_counter()
                row[framework] = measure(model, features, framework, folder, spec_args)
                print(f"  {model} {features} {framework}: {row[framework].get('status')} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            rows.append(row)
    print()
    print(table(rows))
    if args.device == "cpu":
        print()
        print(table(rows, "cpu_seconds"))
    if args.sharded:
        print()
        print(sharded_table(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(spec_args), "rows": rows}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
