"""Archive finished runs into a light folder (docs/data's form) that the other tools read as they
read a live run.

    python -m learner.tools archive runs/fresh_s0 runs/none_s0 --into docs/data/my_question
    python -m learner.tools archive --in-place docs/data/*/*_s?     # re-pack archived folders

A run folder keeps what the tables and plots are computed from: ``config.yaml``, the summaries
(``summary.json``, ``summary.txt``, ``summary_<N>.*``), ``environment.json`` and the metrics,
written as ``metrics.jsonl.gz`` with every float kept to :data:`DIGITS` significant digits
(float32's precision, the precision the losses and statistics are computed in; a table the tools
rebuild reads the same). Checkpoints, episodes and logs stay behind; ``--episodes`` keeps the
final evaluation's episodes as one example (``eval/final/records.jsonl.gz``). The gzip stream is
written by ``zopfli`` where it is installed (about 15% smaller), by Python's gzip otherwise;
either decompresses with any gzip reader.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Significant digits a float keeps in archived metrics (float32 carries 7.2 decimal digits).
DIGITS = 8
#: What an archived run keeps besides its metrics (summary_<N>.* are matched separately).
KEPT = ("config.yaml", "summary.json", "summary.txt", "environment.json")


def round_floats(value: Any, digits: int = DIGITS) -> Any:
    """``value`` with every float (in lists and objects too) kept to ``digits`` significant
    digits; integers, strings, booleans, None and non-finite floats as they are."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}") if math.isfinite(value) else value
    if isinstance(value, list):
        return [round_floats(v, digits) for v in value]
    if isinstance(value, dict):
        return {k: round_floats(v, digits) for k, v in value.items()}
    return value


def pack_metrics(rows: list[dict[str, Any]], digits: int = DIGITS) -> bytes:
    """The JSON lines of ``rows`` with floats kept to ``digits`` significant digits."""
    return "".join(json.dumps(round_floats(row, digits)) + "\n" for row in rows).encode("utf-8")


def write_gzip(data: bytes, dest: Path) -> None:
    """``data`` gzipped into ``dest`` atomically (zopfli where installed, else gzip level 9)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(_zopfli(data) or gzip.compress(data, compresslevel=9, mtime=0))
        if gzip.decompress(Path(tmp).read_bytes()) != data:
            raise OSError(f"{dest}: the compressed metrics do not read back as written")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _zopfli(data: bytes) -> bytes | None:
    """``data`` gzipped by the ``zopfli`` command (it reads a file); None without it."""
    zopfli = shutil.which("zopfli")
    if not zopfli:
        return None
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as raw:
        raw.write(data)
        raw.flush()
        done = subprocess.run([zopfli, "--i5", "-c", raw.name], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return done.stdout if done.returncode == 0 and done.stdout else None


def archive_run(run: Path, dest: Path, episodes: bool = False) -> int:
    """Archive ``run`` into ``dest`` (``dest`` may be ``run``: re-pack it in place); the bytes
    the folder holds afterwards."""
    from learner.report import read_metrics

    if not (run / "metrics.jsonl").is_file() and not (run / "metrics.jsonl.gz").is_file():
        raise FileNotFoundError(f"{run} holds no metrics.jsonl (or .gz): not a run folder")
    rows = read_metrics(run / "metrics.jsonl")
    in_place = dest.resolve() == run.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    if not in_place:
        for path in sorted(run.iterdir()):
            if path.is_file() and (path.name in KEPT or path.name.startswith("summary_")):
                shutil.copy2(path, dest / path.name)
        final = run / "eval" / "final" / "records.jsonl"
        if episodes and final.is_file():
            write_gzip(final.read_bytes(), dest / "eval" / "final" / "records.jsonl.gz")
    write_gzip(pack_metrics(rows), dest / "metrics.jsonl.gz")
    if in_place:
        (run / "metrics.jsonl").unlink(missing_ok=True)  # the archive holds it now
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (live or archived)")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--into", type=Path, help="write each run to INTO/<run folder's name>")
    where.add_argument("--in-place", action="store_true", help="re-pack each (archived) run folder where it is")
    parser.add_argument("--episodes", action="store_true",
                        help="keep the final evaluation's episodes as an example (eval/final/records.jsonl.gz)")
    args = parser.parse_args(argv)
    missing = [str(r) for r in args.runs if not r.is_dir()]
    if missing:
        parser.error(f"not a folder: {', '.join(missing)}")
    for run in args.runs:
        dest = run if args.in_place else args.into / run.name
        if not args.in_place and dest.exists():
            print(f"error: {dest} exists: archive into a new folder", file=sys.stderr)
            return 2
        try:
            size = archive_run(run, dest, episodes=args.episodes)
        except OSError as exc:  # FileNotFoundError (not a run folder) included
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{dest}: {size / 1e3:,.0f} kB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
