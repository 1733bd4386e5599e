"""The machine a run starts on: how OpenMP threads wait, how many CPUs there are, torch's thread
count per phase, and the record of what the run's floating-point results depend on.

Importing this module does nothing (no torch, no ``/proc/stat``, no environment variable):
:func:`choose_omp_wait_policy` is called by ``train.py``'s ``main()`` before anything imports
torch, because the OpenMP runtime torch loads (libgomp) reads ``OMP_WAIT_POLICY`` once, when it
is loaded; set later, the variable has no effect on that process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def busy_cores(seconds: float = 0.5) -> float | None:
    """How many cores other work keeps busy right now: the machine's non-idle CPU time over a
    short window (``/proc/stat``), less this process's own, in cores. None where there is no
    ``/proc/stat``."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
        return sum(values), values[3] + (values[4] if len(values) > 4 else 0)  # total, idle + iowait

    try:
        own0, wall0 = time.process_time(), time.monotonic()
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
        own1, wall1 = time.process_time(), time.monotonic()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    machine = (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)
    return max(0.0, machine - (own1 - own0) / max(wall1 - wall0, 1e-9))


#: What :func:`busy_cores` measured when :func:`default_omp_wait_policy` chose the wait policy
#: (None until then, or where it could not be measured; ``environment.json`` records it).
BUSY_CORES_AT_START: float | None = None


def default_omp_wait_policy() -> str:
    """How idle OpenMP threads should wait on this machine now.

    Spinning (``ACTIVE``) makes the tiny model's updates and pretraining faster than sleeping on
    an otherwise idle machine, but slower than sleeping when another process keeps a core busy
    (docs/performance_train.md). So: ``ACTIVE`` when the machine is idle, else ``PASSIVE``. Idle
    is measured over 0.5 s (under half a core busy): the 1-minute load average, the fallback
    where ``/proc/stat`` is missing, stays high for minutes after work that has ended, such as
    ``make``'s own set-up or a test run just before.
    """
    global BUSY_CORES_AT_START
    busy = BUSY_CORES_AT_START = busy_cores()
    if busy is not None:
        return "ACTIVE" if busy < 0.5 else "PASSIVE"
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: the safe choice
        return "PASSIVE"
    return "ACTIVE" if load < 0.5 else "PASSIVE"


def choose_omp_wait_policy() -> str:
    """Set ``OMP_WAIT_POLICY`` for this process from :func:`default_omp_wait_policy` unless the
    environment already sets it (it wins; ``learner/tools/sweep.py`` sets ``PASSIVE`` for runs
    side by side); return the policy in force. Call it before torch is imported: the OpenMP
    runtime reads the variable once, when torch loads it."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = default_omp_wait_policy()
    return os.environ["OMP_WAIT_POLICY"]


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class torch_threads:
    """Context manager: ``torch.set_num_threads(n)`` inside, the previous count restored after
    (cheap; lets updates use every core while generation keeps its own setting)."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def __enter__(self) -> None:
        import torch

        self.previous = torch.get_num_threads()
        if self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        import torch

        torch.set_num_threads(self.previous)


def environment_record() -> dict[str, Any]:
    """What a run's floating-point results depend on besides its settings: the packages, the
    CPU and the kernels torch picked for it. Runs of one seed on different records may differ
    (docs/results/frozenlake.md#same-seed-another-machine)."""
    import importlib.metadata
    import platform

    import torch

    from learner import distributed

    versions = {}
    for name in ("torch", "transformers", "tokenizers", "numpy", "safetensors", "gymnasium"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
            "cpus": available_cpus(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "packages": versions,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "world_size": distributed.world_size(),
            "busy_cores_at_start": None if BUSY_CORES_AT_START is None else round(BUSY_CORES_AT_START, 3)}


def record_environment(run_dir: Path, rollout_threads: int, update_threads: int, resumed_at: int | None,
                       device: str = "cpu") -> None:
    """Append this start's environment to ``<run>/environment.json`` (a list: the first start,
    then one entry per resume), with the torch device the policy ran on (and the GPU's name)."""
    import torch

    path = run_dir / "environment.json"
    try:
        entries = json.loads(path.read_text(encoding="utf-8")) if path.exists() else []
        if not isinstance(entries, list):
            entries = []
    except (OSError, json.JSONDecodeError):  # an unreadable record is replaced, never fatal
        entries = []
    entries.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_at_iteration": resumed_at,
                    "rollout_threads": rollout_threads, "update_threads": update_threads, **environment_record(),
                    "device": device})
    if device.startswith("cuda"):
        entries[-1]["gpu"] = torch.cuda.get_device_name(torch.device(device))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    os.replace(tmp, path)
