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

Nothing is lost: every line of the metrics must be a JSON object (a damaged line is an error
naming it, exit 2, and nothing is written or deleted; only a torn last line of a killed run is
left out, and then ``--in-place`` keeps ``metrics.jsonl``), the metrics file must be a regular
file, and ``--in-place`` deletes ``metrics.jsonl`` only once the archive reads back with every
row it held.
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

from agents.runfolder import load_metrics
from agents.safeio import UnsafeFileError

#: Significant digits a float keeps in archived metrics (float32 carries 7.2 decimal digits).
DIGITS = 8
#: What an archived run keeps besides its metrics (summary_<N>.* are matched separately).
KEPT = ("config.yaml", "summary.json", "summary.txt", "environment.json")


class ArchiveError(ValueError):
    """Metrics that cannot be archived whole; the message names the file and the line."""


def read_rows(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """The rows of a ``metrics.jsonl`` (or its ``.gz``) and whether a torn last line (no newline
    at its end, not JSON: a killed run's) was left out. Any other line that is not a JSON object,
    not UTF-8 or nested too deeply is an :class:`ArchiveError` naming it; the file must be a
    regular file (no link, FIFO or device) of at most ``agents.runfolder.MAX_METRICS_BYTES``
    (:func:`agents.runfolder.load_metrics` reads it)."""
    archived = path.with_name(path.name + ".gz")
    source = archived if not os.path.lexists(path) and os.path.lexists(archived) else path
    try:
        metrics = load_metrics(path, name=str(source))
    except UnsafeFileError as exc:
        raise ArchiveError(str(exc)) from None
    if metrics.damaged:
        raise ArchiveError(f"{metrics.damaged}: it cannot be archived, so nothing was written or deleted; repair or "
                           "remove that line and run the archive again")
    return metrics.rows, metrics.torn


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
    if not any(os.path.lexists(run / name) for name in ("metrics.jsonl", "metrics.jsonl.gz")):
        raise FileNotFoundError(f"{run} holds no metrics.jsonl (or .gz): not a run folder")
    rows, torn = read_rows(run / "metrics.jsonl")
    in_place = dest.resolve() == run.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    if not in_place:
        for path in sorted(run.iterdir()):
            if path.is_file() and (path.name in KEPT or path.name.startswith("summary_")):
                shutil.copy2(path, dest / path.name)
        final = run / "eval" / "final" / "records.jsonl"
        if episodes and final.is_file():
            write_gzip(final.read_bytes(), dest / "eval" / "final" / "records.jsonl.gz")
    packed = pack_metrics(rows)
    write_gzip(packed, dest / "metrics.jsonl.gz")
    if in_place and os.path.lexists(run / "metrics.jsonl"):
        kept, _ = read_rows(dest / "metrics.jsonl.gz")
        if torn:
            print(f"note: {run / 'metrics.jsonl'} ends in a torn line, which the archive leaves out; "
                  "metrics.jsonl is kept", file=sys.stderr)
        elif len(kept) == len(rows):
            (run / "metrics.jsonl").unlink()  # the archive holds every row of it now
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
        except (OSError, ValueError) as exc:  # not a run folder, a damaged line, not a regular file
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{dest}: {size / 1e3:,.0f} kB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
