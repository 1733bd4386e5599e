"""The trajectory record: one per episode, produced by the runner, stored by the replay
buffer, consumed by the learner. Defined once here; numpy only (no torch).

Token view. An episode is a list of :class:`Sample` s. In ``full`` context mode there is one
sample holding the whole conversation as one growing sequence; in ``window:k`` mode there is
one sample per turn (prompt + reply). In every sample ``loss_mask`` is 1 exactly on tokens the
model sampled and ``behavior_logprobs`` holds their log-probabilities under the policy that
sampled them, at sampling time (0 elsewhere). ``image_ids`` index ``Trajectory.images`` in
the order the images appear in ``token_ids``.

On disk a record is JSON (no pickle) plus PNG images: :func:`save_records` /
:func:`load_records` for a folder of records, :meth:`Trajectory.to_bytes` /
:meth:`Trajectory.from_bytes` for a single self-contained blob (used by replay checkpoints).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from agents.safeio import open_nofollow, open_regular

RECORD_FORMAT_VERSION = 3  # 2: per-sample advantages; 3: the KL reference's log-probs
#: Versions this code reads (1 has no per-sample advantages, 1-2 no reference log-probs).
READABLE_VERSIONS = (1, 2, 3)


@dataclass
class Turn:
    """One environment turn: what the model saw and said, and what it earned."""

    observation: str
    reply: str
    reward: float
    action_is_valid: bool
    image_index: int | None = None  # index into Trajectory.images of this turn's observation image


@dataclass
class Sample:
    """One training sequence: token ids exactly as sampled, mask and behaviour log-probs."""

    token_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # int8 [T], 1 on sampled tokens
    behavior_logprobs: np.ndarray  # float32 [T], 0 where loss_mask == 0
    image_ids: list[int] = field(default_factory=list)
    #: This sample's own advantage (turn-level credit, e.g. ``--advantage gigpo``); None: the
    #: trajectory's episode advantage applies to it.
    advantage: float | None = None
    #: float32 [T]: the KL reference's log-probs of the sampled tokens (0 elsewhere), kept by the
    #: learner the first time it scores the sample (a run's reference never changes, so a replay
    #: update reads them instead of running the reference); None until then.
    reference_logprobs: np.ndarray | None = None
    #: What :attr:`reference_logprobs` were computed under (the learner's key: temperature and
    #: precision); they are used only under the same key.
    reference_key: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.int8)
        self.behavior_logprobs = np.asarray(self.behavior_logprobs, dtype=np.float32)
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"sample arrays differ in length: token_ids {n}, loss_mask {len(self.loss_mask)}, "
                f"behavior_logprobs {len(self.behavior_logprobs)}"
            )
        if self.reference_logprobs is not None:
            self.reference_logprobs = np.asarray(self.reference_logprobs, dtype=np.float32)
            if len(self.reference_logprobs) != n or not isinstance(self.reference_key, str):
                raise ValueError(f"reference_logprobs must have the sample's length ({n}) and a reference_key, got "
                                 f"{len(self.reference_logprobs)} and {self.reference_key!r}")

    @property
    def num_sampled(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class Generation:
    """What one prompt produced in a sampler: sampled ids (ending with EOS unless cut by the
    length limit) and their behaviour log-probs, taken at sampling time."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with EOS (False: hit max_new_tokens)


@dataclass
class Trajectory:
    """A whole episode as the learner needs it (docs/design.md#the-trajectory-record-agentsrecordpy)."""

    env_id: str
    seed: int
    group_id: int
    turns: list[Turn]
    samples: list[Sample]
    episode_return: float
    success: bool
    policy_version: int
    advantage: float = 0.0
    context: str = "window:0"
    images: list[np.ndarray] = field(default_factory=list)  # uint8 (H, W, 3), in order
    truncated: bool = False
    #: True when the episode hit an infrastructure fault (e.g. retrieval down): not learned from.
    failed: bool = False
    info: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable extras

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(s.num_sampled for s in self.samples)

    # -- serialisation ------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        meta = {k: v for k, v in asdict(self).items() if k not in ("samples", "images", "turns")}
        meta["turns"] = [asdict(t) for t in self.turns]
        meta["samples"] = [
            {
                "token_ids": s.token_ids.tolist(),
                "loss_mask": s.loss_mask.tolist(),
                # float32 -> float64 -> JSON repr is exact, and back to float32 is lossless.
                "behavior_logprobs": s.behavior_logprobs.astype(np.float64).tolist(),
                "image_ids": list(s.image_ids),
                "advantage": s.advantage,
                **({} if s.reference_logprobs is None else
                   {"reference_logprobs": s.reference_logprobs.astype(np.float64).tolist(),
                    "reference_key": s.reference_key}),
            }
            for s in self.samples
        ]
        meta["num_images"] = len(self.images)
        meta["format_version"] = RECORD_FORMAT_VERSION
        return meta

    @classmethod
    def _from_meta(cls, meta: dict[str, Any], images: list[np.ndarray]) -> "Trajectory":
        version = meta.pop("format_version", None)
        if version not in READABLE_VERSIONS:
            raise ValueError(f"unsupported record format version {version!r}")
        meta.pop("num_images", None)
        meta["turns"] = [Turn(**t) for t in meta["turns"]]
        meta["samples"] = [Sample(**s) for s in meta["samples"]]
        return cls(images=images, **meta)

    def to_bytes(self) -> bytes:
        """One self-contained blob: a zip of ``meta.json`` and PNG images (no pickle). The zip
        entries carry a fixed date, so equal records give equal bytes."""
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
            zf.writestr(_entry("meta.json"), json.dumps(self._meta()))
            for k, img in enumerate(self.images):
                zf.writestr(_entry(f"image_{k}.png"), _png_bytes(img))
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Trajectory":
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as zf:
                if any(i.compress_type != zipfile.ZIP_STORED or i.file_size > len(blob) for i in zf.infolist()):
                    raise ValueError("compressed or oversized members: not a freshper record")
                meta = json.loads(zf.read("meta.json"))
                images = [_png_array(zf.read(f"image_{k}.png")) for k in range(int(meta["num_images"]))]
            return cls._from_meta(meta, images)
        except (zipfile.BadZipFile, KeyError, TypeError, ValueError, RecursionError, OSError) as exc:
            raise ValueError(f"corrupt trajectory blob: {exc}") from exc


def _entry(name: str) -> zipfile.ZipInfo:
    """A zip entry dated 1980-01-01 (zip's epoch) instead of now."""
    return zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))


def _png_bytes(img: np.ndarray) -> bytes:
    from PIL import Image

    arr = np.asarray(img)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"images must be uint8 (H, W, 3), got {arr.dtype} {arr.shape}")
    out = io.BytesIO()
    Image.fromarray(arr, mode="RGB").save(out, format="PNG")
    return out.getvalue()


#: The most pixels an image in a record may have (the boards are ~0.1 MP); a larger one (a PNG
#: decompression bomb) is refused before it is decoded.
MAX_IMAGE_PIXELS = 16 << 20
#: The most bytes an image file of a record may have.
MAX_IMAGE_BYTES = 64 << 20


def _png_array(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        if im.width * im.height > MAX_IMAGE_PIXELS:
            raise ValueError(f"an image of {im.width}x{im.height} pixels, more than the {MAX_IMAGE_PIXELS:,} read")
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def _read_image(folder: Path, name: Any) -> np.ndarray:
    """The image a record names: a relative path inside the records folder to a regular file
    (not a link, FIFO or device) of at most :data:`MAX_IMAGE_BYTES`, at most
    :data:`MAX_IMAGE_PIXELS` pixels; anything else is a ValueError naming it."""
    from agents.safeio import read_regular

    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"image file {str(name)[:80]!r} is not a path inside {folder}")
    try:
        data = read_regular(folder / name, max_bytes=MAX_IMAGE_BYTES, root=folder)
        return _png_array(data)
    except (OSError, ValueError) as exc:
        raise ValueError(f"image {name}: {exc}") from None
    except Exception as exc:  # PIL's errors on a malformed or oversized image (DecompressionBombError, ...)
        raise ValueError(f"image {name} cannot be decoded ({type(exc).__name__}: {exc})") from None


def save_records(records: Iterable[Trajectory], folder: str | os.PathLike) -> Path:
    """Write records to ``folder/records.jsonl`` plus ``folder/images/<n>_<k>.png``.

    The JSON lines file is written to a temporary name and renamed, so a reader never sees a
    half-written file.
    """
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".records.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        for n, rec in enumerate(records):
            meta = rec._meta()
            meta["image_files"] = []
            for k, img in enumerate(rec.images):
                name = f"images/{n}_{k}.png"
                with open_nofollow(folder / name, "wb") as img_fh:  # never through a planted link
                    img_fh.write(_png_bytes(img))
                meta["image_files"].append(name)
            fh.write(json.dumps(meta) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / "records.jsonl")
    return folder / "records.jsonl"


def load_records(folder: str | os.PathLike, *, images: bool = True) -> list[Trajectory]:
    """Read records written by :func:`save_records` (from ``records.jsonl.gz`` where only the
    gzipped file is there: an archived run). ``images=False`` skips the image files (records
    come back with no images, e.g. from an archive that keeps only the records)."""
    folder = Path(folder)
    path = folder / "records.jsonl"
    archived = folder / "records.jsonl.gz"
    if not path.exists() and not archived.exists():
        raise FileNotFoundError(f"no records.jsonl in {folder}")
    out = []
    fd, _ = open_regular(path if os.path.lexists(path) else archived)  # no link, FIFO or device
    with os.fdopen(fd, "rb") as raw, (io.TextIOWrapper(raw, encoding="utf-8") if os.path.lexists(path)
                                      else gzip.open(raw, "rt", encoding="utf-8")) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                meta = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: corrupt record line ({exc})") from exc
            except (RecursionError, ValueError) as exc:  # nested too deeply, an integer of thousands of digits
                raise ValueError(f"{path}:{lineno}: unreadable record line ({type(exc).__name__})") from None
            if not isinstance(meta, dict):
                raise ValueError(f"{path}:{lineno}: a record line that is not a JSON object")
            files = meta.pop("image_files", [])
            if not isinstance(files, list):
                raise ValueError(f"{path}:{lineno}: image_files is not a list")
            try:
                pixels = [_read_image(folder, f) for f in files] if images else []
                out.append(Trajectory._from_meta(meta, pixels))
            except (KeyError, TypeError, ValueError, AttributeError, RecursionError, OverflowError) as exc:
                raise ValueError(f"{path}:{lineno}: malformed record ({type(exc).__name__}: {str(exc)[:200]})") from None
    return out


def episode_stats(records: Sequence[Trajectory]) -> dict[str, float]:
    """What a batch of episodes achieved, in the numbers every phase logs.

    Failed episodes (an infrastructure fault, e.g. retrieval down) are counted in ``failed``
    and left out of the rest: they say nothing about the policy.
    """
    good = [r for r in records if not r.failed]
    turns = sum(r.num_turns for r in good)
    n = max(1, len(good))
    return {
        "episodes": len(records),
        "failed": len(records) - len(good),
        "success_rate": sum(r.success for r in good) / n,
        "mean_return": float(np.mean([r.episode_return for r in good])) if good else 0.0,
        "invalid_reply_rate": sum(not t.action_is_valid for r in good for t in r.turns) / max(1, turns),
        "mean_turns": turns / n,
        "turns": turns,
        "truncated": sum(r.truncated for r in good),
        "sampled_tokens": sum(r.num_sampled_tokens for r in good),
    }
