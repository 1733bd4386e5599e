"""Replay checkpoints round-trip exactly, are written atomically, and refuse damaged files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from replay import DefaultCodec, ReplayBuffer, ReplayCheckpointError


def make_item(i: int) -> dict:
    return {
        "token_ids": np.arange(i, i + 5, dtype=np.int32),
        "behavior_logprobs": np.linspace(-1, 0, 5, dtype=np.float32) * i,
        "image": np.full((2, 3, 3), i % 256, dtype=np.uint8),
        "env_id": f"freshper/FrozenLake-v0 #{i} ünïcode",
        "return": float(i) / 3,
        "success": bool(i % 2),
        "seed": 2**40 + i,
        "turns": [{"reply": "<answer>Up</answer>", "reward": -0.1}, [1, 2.5, None]],
        "pair": (np.float32(1.5), b"\x00raw"),
        "scalar": np.int64(i),
    }


def assert_items_equal(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_items_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_items_equal(x, y)
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b) and np.array_equal(a, b)
    else:
        assert a == b


def filled_buffer(mode: str = "fresh", **kw) -> ReplayBuffer:
    buf = ReplayBuffer(16, mode=mode, alpha=0.7, tau=3.0, seed=42, **kw)
    rng = np.random.default_rng(0)
    for step in range(0, 50, 5):  # wraps the ring and rebases nothing yet
        buf.add([make_item(step + k) for k in range(3)], rng.exponential(1.0, 3), step)
    buf.update_priorities([25, 26, 0], [5.0, 0.0, 1.0])
    buf.sample(8, 50)  # advance the RNG so its state is not the seed's
    return buf


def test_default_codec_round_trips_nested_items_exactly():
    codec = DefaultCodec()
    item = make_item(7)
    assert_items_equal(codec.decode(codec.encode(item)), item)
    with pytest.raises(TypeError):
        codec.encode({"bad": object()})
    with pytest.raises(TypeError):
        codec.encode({"obj": np.array([None], dtype=object)})


@pytest.mark.parametrize("mode,kw", [("fresh", {}), ("refresh", {}), ("per", {"is_target": "uniform", "is_normalize": "buffer"})])
def test_save_load_round_trip_then_identical_samples(tmp_path, mode, kw):
    buf = filled_buffer(mode, **kw)
    path = tmp_path / "replay.npz"
    buf.save(path)
    back = ReplayBuffer.load(path)
    assert len(back) == len(buf)
    for x, y in zip(buf.items(), back.items()):
        if isinstance(x, list):
            for a, b in zip(x, y):
                assert_items_equal(a, b)
        else:
            assert np.array_equal(x, y)
    for a, b in zip(buf.probabilities(50), back.probabilities(50)):
        assert np.array_equal(a, b)
    for step in (50, 51, 60):
        s, t = buf.sample(32, step), back.sample(32, step)
        assert np.array_equal(s.indices, t.indices)
        assert np.array_equal(s.weights, t.weights) and np.array_equal(s.ages, t.ages)
        for a, b in zip(s.items, t.items):
            assert_items_equal(a, b)
    ids_a = buf.add([make_item(100)], [2.0], step=61)  # the cursor and ids carried over too
    ids_b = back.add([make_item(100)], [2.0], step=61)
    assert ids_a.tolist() == ids_b.tolist()
    assert np.array_equal(buf.sample(16, 62).indices, back.sample(16, 62).indices)
    assert [p.name for p in tmp_path.iterdir()] == ["replay.npz"]  # no temp file left behind


def test_round_trip_with_a_caller_codec(tmp_path):
    class Utf8:
        def encode(self, item: str) -> bytes:
            return item.encode()

        def decode(self, data: bytes) -> str:
            return data.decode()

    buf = ReplayBuffer(4, seed=1)
    buf.add(["alpha", "beta", "gamma"], [1, 2, 3], step=0)
    buf.save(tmp_path / "r.npz", codec=Utf8())
    assert ReplayBuffer.load(tmp_path / "r.npz", codec=Utf8()).items()[1] == ["alpha", "beta", "gamma"]


def test_truncated_or_corrupt_files_raise_checkpoint_error(tmp_path):
    path = tmp_path / "replay.npz"
    filled_buffer().save(path)
    raw = path.read_bytes()
    for name, damaged in {
        "truncated": raw[: len(raw) // 2],
        "empty": b"",
        "garbage": b"not a checkpoint at all",
        "flipped": raw[:600] + bytes([raw[600] ^ 0xFF]) + raw[601:],
        "flipped_late": raw[: len(raw) - 900] + bytes([raw[-900] ^ 0x01]) + raw[len(raw) - 899 :],
    }.items():
        bad = tmp_path / f"{name}.npz"
        bad.write_bytes(damaged)
        with pytest.raises(ReplayCheckpointError):
            ReplayBuffer.load(bad)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ReplayCheckpointError, match="lacks"):
        ReplayBuffer.load(tmp_path / "other.npz")
    with pytest.raises(FileNotFoundError):
        ReplayBuffer.load(tmp_path / "missing.npz")


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "replay.npz"
    buf = filled_buffer()
    buf.save(path)
    before = path.read_bytes()
    buf.add([{"x": object()}], [1.0], step=60)  # the default codec cannot encode this
    with pytest.raises(TypeError):
        buf.save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["replay.npz"]


# -- untrusted files (each a crafted file that loaded, crashed or ate memory before) ----------------
def _saved(tmp_path, n: int = 6):
    from replay import ReplayBuffer

    buf = ReplayBuffer(8, mode="fresh", alpha=1.0, tau=5.0, seed=0)
    buf.add([{"x": np.arange(3) + i} for i in range(n)], np.linspace(0.1, 1.0, n), step=1)
    path = tmp_path / "replay.npz"
    buf.save(path)
    return path


def _rewrite(path, change) -> None:
    """Load the raw arrays, let ``change`` edit them, write them back with a valid checksum."""
    from replay.persistence import read_checkpoint, write_checkpoint

    meta, arrays = read_checkpoint(path, ())
    change(meta, arrays)
    write_checkpoint(path, meta, arrays)


def test_a_compressed_archive_is_refused_before_it_is_decompressed(tmp_path) -> None:
    import time
    import zipfile

    from replay import ReplayBuffer, ReplayCheckpointError

    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("p.npy", b"\0" * (200 << 20))  # 200 MB of zeros, ~200 KB on disk
    assert bomb.stat().st_size < 1 << 20
    t0 = time.perf_counter()
    with pytest.raises(ReplayCheckpointError, match="compressed members"):
        ReplayBuffer.load(bomb)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("change, what", [
    (lambda m, a: a.__setitem__("p", np.full_like(a["p"], np.nan)), "finite"),
    (lambda m, a: m.__setitem__("cursor", 99), "cursor"),
    (lambda m, a: m.__setitem__("size", 7), "lengths"),
    (lambda m, a: a.__setitem__("ids", a["ids"] + 3), "ids"),
    (lambda m, a: a.__setitem__("item_offsets", a["item_offsets"][::-1].copy()), "offsets"),
    (lambda m, a: m.__setitem__("tau", "x"), "inconsistent"),
])
def test_a_checksummed_but_inconsistent_file_is_a_checkpoint_error(tmp_path, change, what) -> None:
    from replay import ReplayBuffer, ReplayCheckpointError

    path = _saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(ReplayCheckpointError, match=what):
        ReplayBuffer.load(path)


def test_items_that_decode_to_none_or_recurse_forever_are_checkpoint_errors(tmp_path) -> None:
    from replay import ReplayBuffer, ReplayCheckpointError
    from replay.persistence import DefaultCodec, pack_items

    class NoneCodec(DefaultCodec):
        def decode(self, data):
            return None

    path = _saved(tmp_path)
    with pytest.raises(ReplayCheckpointError, match="None"):
        ReplayBuffer.load(path, NoneCodec())

    deep = b"FPR1" + len(b"[" * 100_000).to_bytes(8, "little") + b"[" * 100_000

    def nest(meta, arrays):
        offsets, data = pack_items([b"x"] * 6, DefaultCodec())
        data = np.frombuffer(deep * 6, dtype=np.uint8)
        arrays["item_offsets"] = np.arange(7, dtype=np.int64) * len(deep)
        arrays["item_data"] = data

    _rewrite(path, nest)
    with pytest.raises(ReplayCheckpointError):
        ReplayBuffer.load(path)
