"""Lets PyPI's torchvision import beside a CPU-only torch (the vLLM CPU environment, ``make vllm-venv``).

vLLM's Qwen2-VL / Qwen2.5-VL code imports transformers' Qwen2-VL image processor, which imports
torchvision. PyPI only has CUDA builds of torchvision; beside ``torch==X+cpu`` its C++ ops
library cannot load (it links libtorch_cuda), which torchvision tolerates except for two fake
registrations (``torchvision::nms``, ``torchvision::qnms``) that then fail with "operator
torchvision::nms does not exist" and break ``import torchvision``. The image transforms vLLM
needs are pure torch and do not use those ops.

``make vllm-venv`` copies this file into the environment's site-packages with a ``.pth`` line
that calls :func:`install` at start-up. It only installs an import hook: when torchvision is
first imported and its ops library does not load, the two operator schemas are declared (without
kernels: calling them raises), so torchvision imports. Where the library loads, nothing changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARIES: list = []  # keeps the declared schemas alive


class _DeclareMissingOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)  # once, and never in the way of the real import
        spec = importlib.util.find_spec("torchvision")
        if spec is None or not spec.submodule_search_locations:
            return None
        import torch

        folder = list(spec.submodule_search_locations)[0]
        library = next((os.path.join(folder, f) for f in sorted(os.listdir(folder))
                        if f.startswith("_C.") and f.endswith(".so")), None)
        try:
            if library is None:
                raise OSError("no _C library")
            torch.ops.load_library(library)
        except (ImportError, OSError, RuntimeError):
            lib = torch.library.Library("torchvision", "FRAGMENT")  # noqa: TOR901
            for schema in _SCHEMAS:
                lib.define(schema)
            _LIBRARIES.append(lib)
        return spec


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _DeclareMissingOps) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeclareMissingOps())
