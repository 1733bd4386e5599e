#!/usr/bin/env bash
# The vLLM engine's GPU-only parts, in one script (docs/scaling.md, "The vLLM engine"):
#   1. the engine tests on a GPU: the drift conformance test (fp32 engine, text and images), the
#      in-memory sync (the trainer on the engine's GPU: CUDA IPC buckets), LoRA served, train.py
#      --engine vllm on an image task;
#   2. the defaults on a GPU: bf16 weights and CUDA graphs (no enforce_eager), read back from the
#      engine, and the weight sync at 0.5B/1.5B size (benchmarks/vllm_sync_bench.py);
#   3. colocated training of a random-initialised Qwen2.5-VL-3B-size model (engine and learner on
#      one GPU, the engine asleep during updates; LoRA rank 16 with a bf16 base, merged weights
#      pushed through CUDA IPC): tokens/s, sync seconds and peak memory.
#
# Needs an environment with the project and a CUDA build of vLLM >= 0.32 in ONE venv (the trainer
# and the engine then share torch, so NCCL and CUDA IPC handles match):
#     python -m venv .venv-gpu && .venv-gpu/bin/pip install -e '.[dev,vllm]'
#     PY=.venv-gpu/bin/python bash benchmarks/vllm_gpu_check.sh
# Output: $OUT (default runs/vllm-gpu-check) holds every log and the JSON results.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/vllm-gpu-check}
export FRESHPER_VLLM_PYTHON=${FRESHPER_VLLM_PYTHON:-$PY}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" | tee -a "$OUT/gpu.txt"

echo "== 1. the engine tests on the GPU"
"$PY" -m pytest -q tests/agents/engines/test_vllm.py tests/agents/engines/test_vllm_conformance.py -x 2>&1 | tee "$OUT/tests.log"

echo "== 2. GPU defaults (bf16, CUDA graphs) and the weight sync"
"$PY" - <<'EOF' 2>&1 | tee "$OUT/defaults.log"
import torch
from agents.policies.policy import Policy
from agents.policies.tiny import build_tiny_model
from agents.engines.vllm_client import VLLMSampler
path = build_tiny_model("text")
policy = Policy.from_pretrained(path, device="cuda")
s = VLLMSampler(path, eos_token_id=policy.eos_token_id, gpu_memory_utilization=0.3)
try:
    info = s.info()
    print("engine dtype", info["dtype"], "enforce_eager", info["enforce_eager"])
    assert info["dtype"] == "bfloat16" and info["enforce_eager"] is False
    s.push_weights(policy.model, 1)
    print("transport", s.transport(), "sync s", s.sync_seconds)
finally:
    s.close()
EOF
"$PY" benchmarks/vllm_sync_bench.py --json "$OUT/sync.json" 2>&1 | tee "$OUT/sync.log"

echo "== 3. colocated training, Qwen2.5-VL-3B size (random init)"
"$PY" - "$OUT" <<'EOF' 2>&1 | tee "$OUT/colocate.log"
import json, sys, time
from pathlib import Path
import torch
from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLImageProcessor
from agents.policies.tiny import CHAT_TEMPLATE, build_tiny_model
out = Path(sys.argv[1]); folder = out / "qwen25vl-3b-random"
if not (folder / "config.json").exists():
    tok = AutoTokenizer.from_pretrained(build_tiny_model("vision"))
    ids = tok.convert_tokens_to_ids
    # Qwen/Qwen2.5-VL-3B-Instruct's published config (vocab 151936, tied embeddings)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16)
    folder.mkdir(parents=True)
    model.save_pretrained(folder)
    from transformers import Qwen2VLVideoProcessor
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 256),
                        tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                        chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
import train
t0 = time.time()
torch.cuda.reset_peak_memory_stats()
argv = ["--runs-root", str(out), "--run-name", "colocate", "--model", str(folder), "--device", "cuda",
        "--dtype", "bf16", "--env-id", "freshper/FrozenLakeVision-v0", "--engine", "vllm",
        "--vllm-args", json.dumps({"colocate": True}), "--iterations", "4", "--tasks-per-iter", "8",
        "--group-size", "4", "--max-new-tokens", "32", "--gradient-checkpointing", "--lora-rank", "16",
        "--pretrain-steps", "0", "--eval-every", "0", "--final-eval-episodes", "2", "--no-eval-both",
        "--no-diagnostics", "--no-progress",
        "--no-tensorboard"]
code = train.main(argv)
rows = [json.loads(l) for l in (out / "colocate" / "metrics.jsonl").read_text().splitlines()]
rows = [r for r in rows if r.get("kind") == "train"]
print(json.dumps({"rc": code, "wall_s": time.time() - t0, "learner_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "rows": rows},  # per iteration: vllm_sync_s, time splits, tokens_per_s, behavior_logprob_gap
                 indent=1))
EOF
grep -i "colocated vLLM engine\|weight group\|pushed weights" "$OUT/colocate/vllm_engine.log" "$OUT/colocate/"*.log 2>/dev/null | tail -5 || true
echo "done: $OUT"
