"""Does the tiny VLM's vision tower tell FrozenLake's tiles apart? A perception check below the decoder.

    python experiments/vision/vision_features.py                       # the embedded tiny Qwen2-VL, untrained
    python experiments/vision/vision_features.py --model runs/<run>/checkpoints/iter_000100/model --pairs 50

Renders pairs of boards (held-out seeds), runs the vision tower on their images and compares
the features of each 28x28 tile (one visual token after Qwen2-VL's 2x2 merge; the tower's
outputs before the merge are grouped per tile) between the two images: the mean distance where
the tile is the same in both images against where it differs, and the ratio. A ratio near 1
means the tower's output does not depend on the tile: the pixels never reach the decoder. A
large ratio means the information is there, and a policy that ignores the image fails later,
in the decoder. Then, on ``--pairs`` held-out dynamics examples ("image + move -> the next
board"), the decoder's NLL of the target with each example's own image against the images
shifted by one within the batch: how much the decoder's prediction rests on the image.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch



def tile_features(policy, images: list[np.ndarray]) -> torch.Tensor:
    """Vision-tower features per tile: (images, tiles, 4 * dim) for 2x2-merged tiles."""
    out = policy.processor.image_processor(images=images, return_tensors="pt")
    model = policy.model
    visual = model.model.visual if hasattr(model, "model") and hasattr(model.model, "visual") else model.visual
    with torch.no_grad():
        feats = visual(out["pixel_values"], grid_thw=out["image_grid_thw"])
    if not torch.is_tensor(feats):
        feats = feats[0] if isinstance(feats, (tuple, list)) else feats.last_hidden_state
    n = len(images)
    per_image = feats.reshape(n, -1, feats.shape[-1])
    if per_image.shape[1] % 4 == 0 and feats.shape[-1] != model.config.text_config.hidden_size:
        per_image = per_image.reshape(n, per_image.shape[1] // 4, -1)  # the 4 patches of a merged tile
    return per_image


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Qwen2-VL folder (default: the embedded tiny VLM)")
    parser.add_argument("--pairs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import envs
    from agents.policies.policy import Policy
    from agents.policies.tiny import build_tiny_model
    from envs.frozenlake import parse_board
    from agents.rollout.seeds import EVAL_SEED_BASE

    policy = Policy.from_pretrained(args.model or build_tiny_model("vision"))
    env, text_env = envs.make("freshper/FrozenLakeVision-v0"), envs.make("freshper/FrozenLake-v0")
    same, diff = [], []
    for k in range(args.pairs):
        images, boards = [], []
        for seed in (EVAL_SEED_BASE + 2 * k, EVAL_SEED_BASE + 2 * k + 1):
            obs, _ = env.reset(seed=seed)
            text_obs, _ = text_env.reset(seed=seed)
            images.append(np.asarray(obs["image"], dtype=np.uint8))
            boards.append(parse_board(text_obs["text"]))
        f = tile_features(policy, images)
        cells_a = [c for row in boards[0] for c in row]
        cells_b = [c for row in boards[1] for c in row]
        if f.shape[1] != len(cells_a):
            raise SystemExit(f"{f.shape[1]} visual tokens per image but {len(cells_a)} cells: not one token per tile")
        dist = (f[0] - f[1]).norm(dim=-1).tolist()
        for a, b, d in zip(cells_a, cells_b, dist):
            (same if a == b else diff).append(d)
    s, d = float(np.mean(same)), float(np.mean(diff))
    print(f"{args.pairs} image pairs, {len(same)} tiles the same in both, {len(diff)} different")
    print(f"mean feature distance, same tile: {s:.3f}; different tile: {d:.3f}; ratio {d / max(s, 1e-12):.1f}x")

    from learner.pretrain import TransitionStreams, encode
    from learner.update import nll_per_sample

    streams = TransitionStreams("freshper/FrozenLakeVision-v0", {"feedback": False}, args.pairs, EVAL_SEED_BASE, 1.0, True)
    examples = streams.examples()
    streams.close()
    samples, images = encode(policy, examples)
    own = nll_per_sample(policy, samples, images)
    shifted = nll_per_sample(policy, samples, images[1:] + images[:1])
    print(f"next-board NLL per token on {len(examples)} dynamics examples: own image {own.mean():.3f} "
          f"(range {own.min():.2f}-{own.max():.2f}), images shifted by one {shifted.mean():.3f} "
          f"(range {shifted.min():.2f}-{shifted.max():.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
