"""How the learner's weights should reach Ray rollout workers on one machine: Ray's object store
(what ``RayCollector.publish`` does: one ``ray.put`` of the state as numpy arrays, each worker
copies them into its model) vs a collective (a gloo group of the driver and the workers,
``agents.engines.vllm_engine.new_group``, one broadcast per tensor into the workers' own tensors, as
the vLLM engine's in-memory sync does).

    .venv/bin/python -m benchmarks.ray_weight_bench                      # embedded, 0.5B fp32, 0.5B bf16
    .venv/bin/python -m benchmarks.ray_weight_bench --models tiny --repeats 5

Each model is built from its published config (random values; ``tiny`` is the embedded model)
in the dtype the learner keeps on that device (fp32 on CPUs; bf16 is what a GPU learner's
compute copy would send). ``--workers`` Ray actors (1 CPU each) hold the same model; the object
store way is the project's own (``state_to_numpy`` in, ``load_numpy_state`` out, as
``RayCollector.publish`` and a worker's ``set_weights``), the collective sends each distinct
tensor once (a tied head is its embedding). A publish is timed from the driver's first byte to every worker holding the new values
(checked by a checksum against the driver's), the two ways taking turns ``--repeats`` times;
median seconds per publish and the ratio collective / object store are printed side by side.
Results: docs/performance_scale.md, "Weights to Ray workers".
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODELS = {"tiny": ("tiny", torch.float32), "0.5b-fp32": ("qwen2.5-0.5b", torch.float32),
          "0.5b-bf16": ("qwen2.5-0.5b", torch.bfloat16)}


def build(model: str, dtype: torch.dtype, seed: int | None = None) -> torch.nn.Module:
    """``model`` (the embedded one, or a published config via ``benchmarks.real_scale``) in
    ``dtype``: random values from ``seed``, zeros without one (a worker before its first publish)."""
    if model == "tiny":
        from agents.policies.policy import Policy
        from agents.policies.tiny import build_tiny_model

        net = Policy.from_pretrained(build_tiny_model("text")).model
    else:
        from benchmarks.real_scale import build_model

        with torch.device("meta"):
            net = build_model(model)
        net = net.to_empty(device="cpu")
        net.tie_weights()  # to_empty gives the tied head a tensor of its own
    net = net.to(dtype).requires_grad_(False)
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    for p in net.parameters():
        p.normal_(generator=gen) if gen is not None else p.zero_()
    for b in net.buffers():  # rotary tables and the like: the same on both sides
        b.zero_()
    return net


def distinct(net: torch.nn.Module) -> list[torch.Tensor]:
    """The model's tensors, each once (a tied head is its embedding), in state-dict order."""
    return list({t.data_ptr(): t for t in net.state_dict().values()}.values())


def checksum(net: torch.nn.Module) -> float:
    return float(sum(t.float().sum().item() for t in distinct(net)))


class Receiver:
    """One rollout worker's copy of the model, taking published weights in place."""

    def __init__(self, model: str, dtype: str) -> None:
        torch.set_num_threads(1)
        self.net = build(model, getattr(torch, dtype))
        self.group = None

    def join(self, host: str, port: int, world: int, rank: int) -> bool:
        from agents.engines.vllm_engine import new_group

        self.store, self.group = new_group(host, port, world, rank, "gloo", 600.0, None)
        return True

    def receive(self) -> float:
        from agents.engines.vllm_engine import broadcast

        for t in distinct(self.net):
            broadcast(self.group, t)
        return checksum(self.net)

    def take(self, state: dict[str, np.ndarray]) -> float:
        from agents.rollout.transfer import load_numpy_state

        load_numpy_state(self.net, state)  # what a Ray rollout worker's set_weights does
        return checksum(self.net)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(model: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from agents.rollout.transfer import state_to_numpy
    from agents.rollout.workers import worker_runtime_env
    from agents.engines.vllm_engine import broadcast, new_group

    name, dtype = MODELS[model]
    net = build(name, dtype, seed=0)
    tensors = distinct(net)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    actor = ray.remote(num_cpus=1)(Receiver).options(runtime_env=worker_runtime_env())
    workers = [actor.remote(name, str(dtype).removeprefix("torch.")) for _ in range(args.workers)]
    port = free_port()
    joined = [w.join.remote("127.0.0.1", port, args.workers + 1, r + 1) for r, w in enumerate(workers)]
    store, group = new_group("127.0.0.1", port, args.workers + 1, 0, "gloo", 600.0, None)
    ray.get(joined)
    times: dict[str, list[float]] = {"object store": [], "collective": []}
    for k in range(args.repeats):
        with torch.no_grad():  # new weights each publish, as after an update
            for t in tensors:
                t.add_(1e-3)
        want = checksum(net)
        for way in (("object store", "collective") if k % 2 == 0 else ("collective", "object store")):
            t0 = time.perf_counter()
            if way == "object store":
                ref = ray.put(state_to_numpy(net))  # what RayCollector.publish puts
                got = ray.get([w.take.remote(ref) for w in workers])
                del ref
            else:
                pending = [w.receive.remote() for w in workers]
                for t in tensors:
                    broadcast(group, t)
                got = ray.get(pending)
            times[way].append(time.perf_counter() - t0)
            assert all(abs(g - want) <= 1e-6 * max(1.0, abs(want)) for g in got), (way, got, want)
    for w in workers:
        ray.kill(w)
    del group, store
    med = {way: statistics.median(v) for way, v in times.items()}
    return {"model": model, "tensors": len(tensors), "bytes": nbytes, **med, "times": times,
            "ratio": med["collective"] / med["object store"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,0.5b-fp32,0.5b-bf16", help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    import ray

    torch.set_num_threads(1)
    ray.init(num_cpus=args.workers + 1, object_store_memory=6 * 2**30, include_dashboard=False,
             log_to_driver=False)
    one, five, _ = os.getloadavg()
    print(f"{args.workers} Ray workers on one machine, {os.cpu_count()} CPUs, load average {one:.2f} / {five:.2f}; "
          f"median of {args.repeats} publishes each way, taking turns")
    print(f"{'model':<11} {'tensors':>7} {'MB':>8} {'object store s':>15} {'collective s':>13} {'collective / object store':>26}"
          "   every publish, s (object store | collective)")
    try:
        for model in args.models.split(","):
            r = bench(model.strip(), args)
            print(f"{r['model']:<11} {r['tensors']:>7} {r['bytes'] / 1e6:>8.1f} {r['object store']:>15.3f} "
                  f"{r['collective']:>13.3f} {r['ratio']:>25.2f}x   "
                  f"{' '.join(f'{t:.2f}' for t in r['times']['object store'])} | "
                  f"{' '.join(f'{t:.2f}' for t in r['times']['collective'])}", flush=True)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
