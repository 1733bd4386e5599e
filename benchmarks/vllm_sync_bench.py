"""The vLLM engine on real-size models: weight-sync seconds per update, in memory vs the file
round trip, and rollout tokens/s of vLLM vs the project's sampler on the same model and episodes.

    make bench-vllm                                           # everything (~15 min on 2 busy cores)
    .venv/bin/python benchmarks/vllm_sync_bench.py --sizes 0.5b --skip-rollouts
    .venv/bin/python benchmarks/vllm_sync_bench.py --sync-dtype float32 --updates 5
    .venv/bin/python -m benchmarks.vllm_sync_bench --sizes 0.5b   # the same, as a module

Run it with the project installed (``make setup``); it imports the project as a user's code does.
Models are randomly initialised Qwen2.5 decoders of the published configs (below; the embedded
model's tokenizer, whose ids are a subset of the vocabulary) written to a temporary folder.

1. **Weight sync** (``--sizes``, ``--sync-dtype``, default bfloat16 on both sides, the GPU
   default): one engine per size takes ``--updates`` pushes in memory (the weight group:
   gloo broadcast in buckets into the model's ``load_weights``) and ``--updates`` through files
   (``save_pretrained`` to /dev/shm, then vLLM's in-place reload from the folder), alternating;
   median seconds per update as the trainer sees it (send to "engine has the weights"), and the
   largest extra host memory during a push (trainer + engine resident memory + /dev/shm, sampled
   every 10 ms). After the last in-memory push the engine's greedy log-probs are checked against
   the trainer's model ("engine check": bf16 on both sides, so ~1e-2 is agreement; stale weights
   are off by far more).
2. **LoRA** (``--lora-rank``, default 16, all linear layers, on the 0.5B model in
   ``--sync-dtype``): seconds per update of the adapters alone into vLLM's LoRA manager vs the
   merged weights into the plain model (both in memory), and greedy tokens/s of 32 prompts x 32
   tokens with the adapter served vs the merged model.
3. **Rollouts** (fp32 on both sides, the CPU default): tokens/s of one FrozenLake collect
   through the runner (``--tasks`` x ``--group-size`` episodes, ``--turns`` turns of
   ``--new-tokens`` sampled tokens, window:0 context) with the project's sampler and with
   vLLM, the same seeds, model and episodes, taking turns ``--repeats`` times (median; the
   engine computes with this process's torch threads); text on the 0.5B model, images on a Qwen2-VL with
   the 0.5B decoder and the embedded model's 2-layer vision tower (one image per turn).

Every ratio compares rows of this run; the load average is printed before and after, since the
machine's cores are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

#: Published Qwen2.5 configs (Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B config.json).
QWEN25 = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
}
COMMON = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
              max_position_embeddings=32768, hidden_act="silu")
LAKE, LAKE_VISION = "freshper/FrozenLake-v0", "freshper/FrozenLakeVision-v0"


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def tokenizer_folder() -> Path:
    from agents.policies.tiny import build_tiny_model

    return build_tiny_model("text")


def build_text_model(size: str, folder: Path, dtype: torch.dtype) -> Path:
    """A randomly initialised Qwen2.5 of the published ``size`` config, saved in ``dtype``."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_folder())
    cfg = Qwen2Config(**QWEN25[size], **COMMON, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def build_vision_model(folder: Path) -> Path:
    """Qwen2-VL with the 0.5B decoder and the embedded model's vision tower (multimodal rope)."""
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from agents.policies.tiny import _vision_processor, build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model("vision"))
    ids = tok.convert_tokens_to_ids
    head = QWEN25["0.5b"]["hidden_size"] // QWEN25["0.5b"]["num_attention_heads"]  # 64: mrope sections of 32
    text = dict(**QWEN25["0.5b"], **{k: v for k, v in COMMON.items() if k not in ("rope_theta", "tie_word_embeddings")},
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]},
                bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 == head
    cfg = Qwen2VLConfig(text_config=text,
                        vision_config=dict(depth=2, embed_dim=96, hidden_size=QWEN25["0.5b"]["hidden_size"],
                                           num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                                           temporal_patch_size=2),
                        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
                        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _vision_processor(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


class HostMemory:
    """Peak extra host memory while a push runs: the trainer's and the engine's resident memory
    plus /dev/shm's used bytes, sampled every 10 ms, above their level before the push."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids

    def _now(self) -> int:
        total = 0
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/statm") as fh:
                    total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass
        st = os.statvfs("/dev/shm")
        return total + (st.f_blocks - st.f_bfree) * st.f_frsize

    def __enter__(self) -> "HostMemory":
        import threading

        self.base = self.peak = self._now()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.01):
                self.peak = max(self.peak, self._now())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.extra = max(0, self.peak - self.base)


def sync_bench(size: str, root: Path, dtype: str, updates: int, python: str) -> dict:
    from agents.policies.policy import Policy
    from agents.engines.vllm_client import VLLMSampler

    torch_dtype = getattr(torch, dtype)
    folder = build_text_model(size, root / f"qwen2.5-{size}", torch_dtype)
    policy = Policy.from_pretrained(folder, dtype=torch_dtype)
    n_params = sum(p.numel() for p in policy.model.parameters())
    sampler = VLLMSampler(folder, eos_token_id=policy.eos_token_id, python=python, dtype=dtype, max_model_len=512)
    times: dict[str, list[float]] = {"memory": [], "files": []}
    extra: dict[str, list[int]] = {"memory": [], "files": []}
    try:
        for u in range(updates):
            for mode in ("memory", "files"):
                sampler.weight_sync = mode
                with HostMemory([os.getpid(), sampler.proc.pid]) as mem:
                    t0 = time.perf_counter()
                    sampler.push_weights(policy.model, 2 * u + (mode == "files"))
                    times[mode].append(time.perf_counter() - t0)
                extra[mode].append(mem.extra)
        sampler.weight_sync = "memory"
        with torch.no_grad():  # an update the engine must follow
            policy.model.model.norm.weight.mul_(1.5)
        sampler.push_weights(policy.model, 99)
        prompt = [policy.chat.first_message("FrozenLake: reach the goal. <answer>Up</answer>", [])]
        got = sampler.generate(prompt, max_new_tokens=4, greedy=True)[0]
        from agents.record import Sample

        ids = prompt[0] + got.token_ids
        with torch.no_grad():
            lp = policy.token_logprobs([Sample(ids, [0] * len(prompt[0]) + [1] * 4, [0.0] * len(ids))])[0]
        gap = float((lp[len(prompt[0]):len(ids)] - torch.tensor(got.logprobs)).abs().max())
    finally:
        sampler.close()
        del policy
        shutil.rmtree(folder, ignore_errors=True)
    return {"size": size, "params": n_params, "dtype": dtype, "memory_s": statistics.median(times["memory"]),
            "files_s": statistics.median(times["files"]), "all": times, "check_gap": gap,
            "memory_extra_gib": max(extra["memory"]) / 2**30, "files_extra_gib": max(extra["files"]) / 2**30}


def lora_bench(root: Path, dtype: str, rank: int, updates: int, python: str) -> dict:
    from agents.policies.lora import LoraSettings, add_lora
    from agents.policies.policy import Policy
    from agents.engines.vllm_client import VLLMSampler

    torch_dtype = getattr(torch, dtype)
    folder = build_text_model("0.5b", root / "lora-0.5b", torch_dtype)
    policy = Policy.from_pretrained(folder, dtype=torch_dtype)
    add_lora(policy, LoraSettings(rank=rank))
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    prompts = [policy.chat.first_message(f"FrozenLake {i}: reach the goal. <answer>Up</answer>", []) for i in range(32)]
    out: dict = {"rank": rank, "dtype": dtype}
    for mode in ("merged", "adapter"):
        sampler = VLLMSampler(folder, eos_token_id=policy.eos_token_id, python=python, dtype=dtype, max_model_len=512,
                              lora=LoraSettings(rank=rank) if mode == "adapter" else None)
        try:
            times = []
            for u in range(updates):
                t0 = time.perf_counter()
                sampler.push_weights(policy.model, u)
                times.append(time.perf_counter() - t0)
            sampler.generate(prompts[:2], max_new_tokens=4, greedy=True)  # warm-up
            t0 = time.perf_counter()
            gens = sampler.generate(prompts, max_new_tokens=32, greedy=True)
            wall = time.perf_counter() - t0
            out[mode] = {"sync_s": statistics.median(times), "tok_s": sum(len(g.token_ids) for g in gens) / wall,
                         "all": times}
        finally:
            sampler.close()
    del policy
    shutil.rmtree(folder, ignore_errors=True)
    return out


def rollout_bench(kind: str, root: Path, args: argparse.Namespace) -> dict:
    from agents.policies.spec import PolicySpec
    from agents.rollout.engine import EngineSettings, vllm_sampler
    from agents.policies.policy import Policy
    from agents.rollout.runner import RolloutSettings

    if kind == "text":
        folder, env_id = build_text_model("0.5b", root / "rollout-text", torch.float32), LAKE
    else:
        folder, env_id = build_vision_model(root / "rollout-vision"), LAKE_VISION
    policy = Policy.from_pretrained(folder)
    rollout = RolloutSettings(env_id, {"max_turns": args.turns, "feedback": False}, "window:0",
                            group_size=args.group_size, max_new_tokens=args.new_tokens, max_context_tokens=2048)
    seeds = list(range(args.tasks))
    out = {"kind": kind, "model": "Qwen2.5-0.5B decoder" + (" + 2-layer vision tower" if kind == "image" else "")}
    sampler = vllm_sampler(policy, folder, rollout, seed=0, spec=PolicySpec(torch.float32),
                           engine=EngineSettings("vllm", args.vllm_python, {"max_model_len": 2048}))
    runs: dict[str, list[tuple[int, float]]] = {"hf": [], "vllm": []}
    try:
        runners = {"hf": rollout.runner(policy, seed=0), "vllm": rollout.runner(policy, seed=0, sampler=sampler)}
        for runner in runners.values():  # warm-up (first-call allocations, vLLM's caches)
            runner.collect(seeds[:1], policy_version=0, rng_seed=3)
        for _ in range(args.repeats):  # the two take turns, so a change of the machine's load falls on both
            for name, runner in runners.items():
                t0 = time.perf_counter()
                records, _ = runner.collect(seeds, policy_version=0, rng_seed=11)
                runs[name].append((sum(r.num_sampled_tokens for r in records), time.perf_counter() - t0))
        for runner in runners.values():
            runner.close()
    finally:
        sampler.close()
        del policy
        shutil.rmtree(folder, ignore_errors=True)
    for name, rows in runs.items():
        out[name] = {"tokens": rows[0][0], "s": statistics.median(s for _, s in rows), "all_s": [s for _, s in rows]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5b,1.5b", help="comma-separated: 0.5b, 1.5b")
    parser.add_argument("--sync-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--updates", type=int, default=3, help="pushes per mode and size")
    parser.add_argument("--skip-sync", action="store_true")
    parser.add_argument("--skip-rollouts", action="store_true")
    parser.add_argument("--skip-lora", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="collects per sampler (taking turns; median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: agents.policies.policy's rule)")
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    from agents.policies.policy import configure_threads
    from agents.engines.vllm_client import default_vllm_python

    args.vllm_python = args.vllm_python or default_vllm_python()
    threads = configure_threads(args.threads)
    print(f"torch {torch.__version__}, {threads} thread(s); {load()}", flush=True)
    results: dict = {"sync": [], "rollouts": [], "lora": None}
    root = Path(tempfile.mkdtemp(prefix="freshper-vllm-bench-"))
    try:
        if not args.skip_sync:
            for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
                r = sync_bench(size, root, args.sync_dtype, args.updates, args.vllm_python)
                results["sync"].append(r)
                print(f"sync {size}: {r}", flush=True)
        if not args.skip_lora:
            results["lora"] = lora_bench(root, args.sync_dtype, args.lora_rank, args.updates, args.vllm_python)
            print(f"lora: {results['lora']}", flush=True)
        if not args.skip_rollouts:
            for kind in ("text", "image"):
                r = rollout_bench(kind, root, args)
                results["rollouts"].append(r)
                print(f"rollouts {kind}: {r}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    if results["sync"]:
        print(f"Weight sync, seconds per update (median of {args.updates}; {args.sync_dtype} on both sides)")
        print("| model | parameters | in memory (s) | files via /dev/shm (s) | files / memory | extra host memory, "
              "in memory / files (GiB) | engine check |")
        print("|---|---|---|---|---|---|---|")
        for r in results["sync"]:
            print(f"| Qwen2.5-{r['size'].upper()} (random init) | {r['params'] / 1e9:.2f} B | {r['memory_s']:.2f} | "
                  f"{r['files_s']:.2f} | {r['files_s'] / r['memory_s']:.2f}x | {r['memory_extra_gib']:.2f} / "
                  f"{r['files_extra_gib']:.2f} | {r['check_gap']:.1e} |")
    if results["lora"]:
        r = results["lora"]
        print()
        print(f"LoRA rank {r['rank']} (all linear layers) on Qwen2.5-0.5B, {r['dtype']}, both in memory")
        print("| engine holds | seconds per update | greedy tok/s (32 x 32) |")
        print("|---|---|---|")
        print(f"| the merged weights | {r['merged']['sync_s']:.3f} | {r['merged']['tok_s']:.1f} |")
        print(f"| the base + a served adapter | {r['adapter']['sync_s']:.3f} | {r['adapter']['tok_s']:.1f} |")
    if results["rollouts"]:
        print()
        print(f"Rollouts, {args.tasks} x {args.group_size} FrozenLake episodes of {args.turns} turns x "
              f"{args.new_tokens} tokens (fp32)")
        print("| task | model | project's sampler (tok/s) | vLLM (tok/s) | vLLM / project's |")
        print("|---|---|---|---|---|")
        for r in results["rollouts"]:
            hf = r["hf"]["tokens"] / r["hf"]["s"]
            vl = r["vllm"]["tokens"] / r["vllm"]["s"]
            print(f"| {r['kind']} | {r['model']} | {hf:.1f} | {vl:.1f} | {vl / hf:.2f}x |")
    print(f"\n{load()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
