"""Checkpoint files for the replay buffer: atomic, checksummed, and free of pickle.

A checkpoint is an ``.npz`` archive read with ``allow_pickle=False``. Items are opaque to the
buffer, so they cross the disk boundary through a codec (``encode(item) -> bytes`` and
``decode(bytes) -> item``); ``DefaultCodec`` handles dicts and lists of numpy arrays, strings,
bytes and numbers. A SHA-256 over every array detects corruption that the zip layer misses.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import zipfile
from typing import Any, Protocol

import numpy as np

_DIGEST_KEY = "__sha256__"
_MAGIC = b"FPR1"


class ReplayCheckpointError(RuntimeError):
    """A replay checkpoint is missing parts, truncated, corrupt, or from an incompatible version."""


class ItemCodec(Protocol):
    """Turns one opaque buffer item into bytes and back, exactly."""

    def encode(self, item: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class DefaultCodec:
    """Exact codec for nested dicts (str keys), lists and tuples of numpy arrays and scalars,
    str, bytes, int, float, bool and None: a JSON skeleton followed by the raw array bytes."""

    def encode(self, item: Any) -> bytes:
        chunks: list[bytes] = []
        offset = [0]

        def blob(raw: bytes) -> list[int]:
            chunks.append(raw)
            offset[0] += len(raw)
            return [offset[0] - len(raw), len(raw)]

        def walk(x: Any) -> Any:
            if x is None or isinstance(x, (bool, int, float, str)):
                return x
            if isinstance(x, (np.ndarray, np.generic)):
                a = np.asarray(x)
                if a.dtype.hasobject or a.dtype.fields is not None:
                    raise TypeError(f"DefaultCodec cannot encode arrays of dtype {a.dtype}")
                tag = "a" if isinstance(x, np.ndarray) else "s"
                return {tag: blob(np.ascontiguousarray(a).tobytes()) + [a.dtype.str, list(a.shape)]}
            if isinstance(x, bytes):
                return {"b": blob(x)}
            if isinstance(x, list):
                return {"l": [walk(v) for v in x]}
            if isinstance(x, tuple):
                return {"t": [walk(v) for v in x]}
            if isinstance(x, dict):
                if not all(isinstance(k, str) for k in x):
                    raise TypeError("DefaultCodec encodes dicts with str keys only")
                return {"d": [[k, walk(v)] for k, v in x.items()]}
            raise TypeError(f"DefaultCodec cannot encode {type(x).__name__}; pass a codec to save/load")

        head = json.dumps(walk(item), separators=(",", ":")).encode()
        return _MAGIC + struct.pack("<Q", len(head)) + head + b"".join(chunks)

    def decode(self, data: bytes) -> Any:
        if data[:4] != _MAGIC:
            raise ValueError("not a DefaultCodec payload")
        (n,) = struct.unpack("<Q", data[4:12])
        body = memoryview(data)[12 + n :]

        def walk(x: Any) -> Any:
            if not isinstance(x, dict):
                return x
            (tag, v), = x.items()
            if tag == "a" or tag == "s":
                start, size, dtype, shape = v
                a = np.frombuffer(body[start : start + size], dtype=np.dtype(dtype)).reshape(shape).copy()
                return a if tag == "a" else a[()]
            if tag == "b":
                return bytes(body[v[0] : v[0] + v[1]])
            if tag == "l":
                return [walk(e) for e in v]
            if tag == "t":
                return tuple(walk(e) for e in v)
            return {k: walk(e) for k, e in v}

        return walk(json.loads(bytes(data[12 : 12 + n])))


def pack_items(items: list[Any], codec: ItemCodec) -> tuple[np.ndarray, np.ndarray]:
    """Encode items into one byte array plus ``len + 1`` offsets."""
    blobs = [codec.encode(item) for item in items]
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return offsets, np.frombuffer(b"".join(blobs), dtype=np.uint8)


def unpack_items(offsets: np.ndarray, data: np.ndarray, codec: ItemCodec) -> list[Any]:
    """Decode what :func:`pack_items` wrote; offsets must start at 0, never decrease and end at
    the data's length, and no item may decode to None."""
    offsets = np.asarray(offsets)
    if (offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) == 0 or offsets[0] != 0
            or offsets[-1] != len(data) or np.any(np.diff(offsets) < 0)):
        raise ValueError("item offsets are inconsistent with the item data")
    raw = data.tobytes()
    items = [codec.decode(raw[offsets[i] : offsets[i + 1]]) for i in range(len(offsets) - 1)]
    if any(item is None for item in items):
        raise ValueError("an item decoded to None")
    return items


def _digest(arrays: dict[str, np.ndarray]) -> np.ndarray:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return np.frombuffer(h.hexdigest().encode(), dtype=np.uint8)


def write_checkpoint(path: str | os.PathLike, meta: dict, arrays: dict[str, np.ndarray]) -> None:
    """Write ``meta`` (JSON) and ``arrays`` atomically: temp file, fsync, ``os.replace``."""
    path = os.fspath(path)
    payload = dict(arrays, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    payload[_DIGEST_KEY] = _digest(payload)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".replay-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _check_archive(path: str) -> None:
    """Refuse an archive this module did not write before decompressing anything: ``np.savez``
    stores members uncompressed, so a compressed member (a zip bomb, say) or members larger
    than the file itself mean the file is not a freshper replay checkpoint."""
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ReplayCheckpointError(f"replay checkpoint {path!r} is truncated or corrupt: {exc}") from exc
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise ReplayCheckpointError(f"replay checkpoint {path!r} has compressed members: not a freshper replay file")
    if sum(i.file_size for i in infos) > size:
        raise ReplayCheckpointError(f"replay checkpoint {path!r} claims more data than the file holds: corrupt")


def read_checkpoint(path: str | os.PathLike, required: tuple[str, ...]) -> tuple[dict, dict[str, np.ndarray]]:
    """Read and verify a checkpoint; any damage raises ``ReplayCheckpointError``."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    _check_archive(path)
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:  # we close f, even on errors
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # zip, npy-header and CRC errors all mean the same thing here
        raise ReplayCheckpointError(f"replay checkpoint {path!r} is truncated or corrupt: {exc}") from exc
    missing = [k for k in (*required, "meta", _DIGEST_KEY) if k not in arrays]
    if missing:
        raise ReplayCheckpointError(f"replay checkpoint {path!r} lacks {missing}; not a freshper replay file?")
    stored = arrays.pop(_DIGEST_KEY)
    if not np.array_equal(stored, _digest(arrays)):
        raise ReplayCheckpointError(f"replay checkpoint {path!r} failed its checksum: the file is corrupt")
    try:
        meta = json.loads(arrays.pop("meta").tobytes())
    except (ValueError, RecursionError) as exc:
        raise ReplayCheckpointError(f"replay checkpoint {path!r} has unreadable metadata: {exc}") from exc
    if not isinstance(meta, dict):
        raise ReplayCheckpointError(f"replay checkpoint {path!r} has unreadable metadata: not an object")
    return meta, arrays
