"""``python -m learner.tools archive``: a finished run packed into docs/data's form reads back
through the tools as the run did."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import shutil
from pathlib import Path

from learner.report import read_metrics
from learner.tools import archive, run_stats

REPO = Path(__file__).resolve().parents[2]
#: an archived run with episodes beside it (docs/data/README.md lists the examples)
EXAMPLE = REPO / "docs" / "data" / "searchqa" / "short_s0"


def _stats(run: Path) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_stats.main([str(run)]) == 0
    return [line.replace(str(run), "RUN") for line in out.getvalue().splitlines()]


def _live_copy(tmp_path: Path) -> Path:
    """EXAMPLE as the run folder train.py left: plain metrics, episodes, a checkpoint, a log."""
    run = tmp_path / "runs" / "short_s0"
    shutil.copytree(EXAMPLE, run)
    (run / "metrics.jsonl").write_bytes(gzip.decompress((run / "metrics.jsonl.gz").read_bytes()))
    (run / "metrics.jsonl.gz").unlink()
    final = run / "eval" / "final"
    (final / "records.jsonl").write_bytes(gzip.decompress((final / "records.jsonl.gz").read_bytes()))
    (final / "records.jsonl.gz").unlink()
    (run / "checkpoints" / "iter_000002").mkdir(parents=True)
    (run / "checkpoints" / "iter_000002" / "model.safetensors").write_bytes(b"\0" * 64)
    (run / "train.log").write_text("a log\n")
    return run


def test_floats_keep_eight_significant_digits_and_nothing_else_changes() -> None:
    row = {"i": 3, "b": True, "s": "0.123456789123", "n": None, "nan": math.nan, "inf": -math.inf,
           "x": 0.07323766425251961, "big": 174.16306288300075, "tiny": 1.2345678912e-12,
           "hist": [0.5, 1 / 3, 7], "nested": {"ess": 2 / 3}}
    out = archive.round_floats(row)
    assert {k: out[k] for k in ("i", "b", "s", "n", "inf")} == {k: row[k] for k in ("i", "b", "s", "n", "inf")}
    assert type(out["i"]) is int and type(out["b"]) is bool and math.isnan(out["nan"])
    assert (out["x"], out["big"], out["tiny"]) == (0.073237664, 174.16306, 1.2345679e-12)
    assert out["hist"] == [0.5, 0.33333333, 7] and out["nested"] == {"ess": 0.66666667}


def test_an_archived_run_reads_back_through_the_tools_as_the_live_run(tmp_path: Path) -> None:
    live = _live_copy(tmp_path)
    assert archive.main([str(live), "--into", str(tmp_path / "docs"), "--episodes"]) == 0
    packed = tmp_path / "docs" / "short_s0"
    assert sorted(p.relative_to(packed).as_posix() for p in packed.rglob("*") if p.is_file()) == [
        "config.yaml", "eval/final/records.jsonl.gz", "metrics.jsonl.gz", "summary.json", "summary.txt"]
    assert gzip.decompress((packed / "eval/final/records.jsonl.gz").read_bytes()) == \
        (live / "eval/final/records.jsonl").read_bytes()
    before, after = read_metrics(live / "metrics.jsonl"), read_metrics(packed / "metrics.jsonl")
    assert [sorted(r) for r in before] == [sorted(r) for r in after]
    for old, new in zip(before, after):
        for key, value in old.items():
            if isinstance(value, float):
                assert math.isclose(new[key], value, rel_tol=5e-8) or (math.isnan(value) and math.isnan(new[key]))
            elif not isinstance(value, (list, dict)):
                assert new[key] == value and type(new[key]) is type(value)
    assert _stats(packed) == _stats(live)
    # Re-packing an archive in place changes nothing more: its floats already have 8 digits.
    first = gzip.decompress((packed / "metrics.jsonl.gz").read_bytes())
    assert archive.main(["--in-place", str(packed)]) == 0
    assert gzip.decompress((packed / "metrics.jsonl.gz").read_bytes()) == first
    assert [json.loads(line) for line in first.decode().splitlines()] == after


def test_bad_targets_are_refused_with_a_reason(tmp_path: Path, capsys) -> None:
    live = _live_copy(tmp_path)
    assert archive.main([str(live), "--into", str(tmp_path / "docs")]) == 0
    assert archive.main([str(live), "--into", str(tmp_path / "docs")]) == 2
    assert "exists" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert archive.main([str(tmp_path / "empty"), "--into", str(tmp_path / "out")]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_in_place_never_deletes_what_it_could_not_archive(tmp_path: Path, capsys) -> None:
    """The repro (issue 54 item 9): ``archive --in-place`` on metrics with one damaged middle line
    dropped the line, deleted ``metrics.jsonl`` and exited 0. Now a damaged or non-UTF-8 line is
    an error naming it and nothing is written or deleted; a torn last line (a killed run's) is
    left out of the archive and ``metrics.jsonl`` kept; a FIFO is refused, not waited on."""
    import os

    live = _live_copy(tmp_path)
    metrics = live / "metrics.jsonl"
    good = metrics.read_bytes()
    lines = good.splitlines(keepends=True)
    for damage, problem in ((b'{"iteration": 2, "loss": 0.\n', "line 3 is not valid JSON"),
                            (b"\xff\xfe garbage\n", "line 3 is not UTF-8"),
                            (b"[1, 2]\n", "line 3 is a JSON list, not an object")):
        metrics.write_bytes(b"".join(lines[:2]) + damage + b"".join(lines[2:]))
        before = metrics.read_bytes()
        assert archive.main(["--in-place", str(live)]) == 2
        err = capsys.readouterr().err
        assert problem in err and "nothing was written or deleted" in err and "Traceback" not in err, err
        assert metrics.read_bytes() == before and not (live / "metrics.jsonl.gz").exists()
        assert archive.main([str(live), "--into", str(tmp_path / "out")]) == 2
        assert problem in capsys.readouterr().err and not (tmp_path / "out" / live.name / "metrics.jsonl.gz").exists()
    torn = good + b'{"iteration": 99, "lo'
    metrics.write_bytes(torn)
    assert archive.main(["--in-place", str(live)]) == 0
    assert "torn line" in capsys.readouterr().err and metrics.read_bytes() == torn
    assert archive.read_rows(live / "metrics.jsonl.gz") == (archive.read_rows(metrics)[0], False)
    metrics.write_bytes(good)
    assert archive.main(["--in-place", str(live)]) == 0 and not metrics.exists()  # whole: the archive holds it
    os.mkfifo(metrics)
    assert archive.main(["--in-place", str(live)]) == 2
    assert "not a regular file" in capsys.readouterr().err
