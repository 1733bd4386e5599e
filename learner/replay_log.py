"""The replay log: which buffer items each replay update drew, and why, per run.

``train.py`` writes ``runs/<name>/replay_log/`` while it trains (``--replay-log-mb``; the
viewer's replay page and its episode pages read it, docs/view.md). Per iteration it records:

Iterations are numbered as in ``metrics.jsonl`` (the first is 1). Rows, one JSON object a line:

- ``episode``: each record entering the buffer, under its buffer item id (stable for the run:
  ``ReplayBuffer.add`` numbers items consecutively, and a resumed buffer goes on numbering):
  task seed, group, return, success, advantage, the turns (observation text, cut at
  :data:`MAX_OBSERVATION_CHARS`; reply; reward; validity) and per sample its sampled tokens
  (ids and behaviour log-probs, one list per contiguous run) and its own advantage. Prompt tokens
  and images are not kept;
- ``draw``: each replay update: the drawn ids with their ages, base priorities, freshness factors
  ``exp(-age / tau)``, sampling probabilities and IS weights (``ReplaySample``), the advantage
  of every sample the update trained on, the replay-time log IS ratio ``log pi - log mu`` of
  every sampled token (as the learner computed it, before its step), the update's statistics
  (gradient norm, clip fraction, ESS per age bucket, ...) and the tau it drew with;
- ``iteration``: the buffer's age histogram and sampling mass per age bucket after the
  iteration, tau and (``--tau auto``) the fitted drift, the on-policy update's statistics, and
  the seconds the log itself took.

Format: gzip-compressed JSON lines in segment files ``seg-NNNNNN.jsonl.gz``; every iteration is
one gzip member appended and flushed when the iteration ends (no fsync), so a killed run leaves
every whole iteration readable and at most a torn last member, which readers skip. Each segment
starts with a ``header`` member. A segment is closed once it holds 1/:data:`SEGMENTS` of the cap;
when the folder would exceed the cap the oldest segments are deleted whole, so the log keeps the
newest iterations within ``--replay-log-mb``. On resume, iterations after the checkpoint are
removed (as ``metrics.jsonl``'s lines are), so the log reads as if the run had never stopped.

A run folder may come from elsewhere, so every segment is read as untrusted input, by the
readers of :mod:`agents.runfolder` (which the viewer reads with too): a regular file opened
without following a link or blocking (a FIFO named like a segment used to hang a resume), at most
``MAX_SEGMENT_BYTES``, its members decompressed with a cap checked while decompressing
(``MAX_SEGMENT_TEXT``, at most ``MAX_RATIO`` times the file), each line a JSON object. Anything
else is an :class:`agents.safeio.UnsafeFileError` naming the segment.

Nothing here draws random numbers or changes what the learner computes: the log reads the
buffer's sample and the update's statistics after the fact, and the per-token ratios through
``policy_update``'s ``observe`` hook (a detached copy). ``python -m learner.replay_log RUN``
prints a run's log size per iteration.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agents.runfolder import REPLAY_LOG, SEGMENT, read_members, read_replay_log, read_segment, segment_paths
from agents.safeio import UnsafeFileError, open_nofollow

logger = logging.getLogger(__name__)

FOLDER = REPLAY_LOG
FORMAT_VERSION = 1
#: The cap is kept in this many segments: the oldest is deleted once the cap is reached.
SEGMENTS = 8
#: Observation text kept per turn (longer ones are cut, with the length they had).
MAX_OBSERVATION_CHARS = 4000
#: Age bucket edges (optimizer steps) of the buffer histograms: ``ReplayBuffer.age_stats``'s.
AGE_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Update statistics kept per replay or on-policy update.
STAT_KEYS = ("grad_norm", "clip_frac", "ess", "kl", "loss", "tokens", "ratio_mean", "ratio_max", "ratio_min",
             "drift_per_step", "clip_drift_per_step", "weight_mean", "skipped", "fp16_overflow")


def _r(x: float, digits: int = 6) -> float | None:
    """A float rounded for the log (None for NaN or infinity)."""
    x = float(x)
    return round(x, digits) if np.isfinite(x) else None


def _stats(stats: dict[str, Any]) -> dict[str, Any]:
    out = {k: _r(stats[k]) for k in STAT_KEYS if isinstance(stats.get(k), (int, float))}
    out.update({k: _r(v) for k, v in stats.items() if k.startswith(("ess/age_", "clip_out/age_"))
                and isinstance(v, (int, float))})
    return out


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` runs where ``mask`` is non-zero."""
    on = np.flatnonzero(np.diff(np.concatenate([[0], (np.asarray(mask) > 0).astype(np.int8), [0]])))
    return list(zip(on[::2].tolist(), on[1::2].tolist()))


def episode_entry(item_id: int, iteration: int, step: float, rec: Any) -> dict[str, Any]:
    """The log's ``episode`` line of a record entering the buffer as ``item_id``."""
    turns = []
    for t in rec.turns:
        obs = t.observation
        cut = len(obs) if len(obs) > MAX_OBSERVATION_CHARS else None
        turns.append([obs[:MAX_OBSERVATION_CHARS], t.reply, _r(t.reward), bool(t.action_is_valid)]
                     + ([cut] if cut else []))
    samples = []
    for s in rec.samples:
        spans = _runs(s.loss_mask)
        samples.append({"ids": [s.token_ids[a:b].tolist() for a, b in spans],
                        "lp": [[round(float(v), 5) for v in s.behavior_logprobs[a:b]] for a, b in spans],
                        "adv": None if s.advantage is None else _r(s.advantage)})
    return {"type": "episode", "id": int(item_id), "iteration": int(iteration), "step": float(step),
            "env_id": rec.env_id, "seed": int(rec.seed), "group": int(rec.group_id), "return": _r(rec.episode_return),
            "success": bool(rec.success), "advantage": _r(rec.advantage), "context": rec.context,
            "truncated": bool(rec.truncated), "policy_version": int(rec.policy_version), "turns": turns,
            "samples": samples, "end": {k: rec.info[k] for k in ("final_observation", "end_reason")
                                        if isinstance(rec.info.get(k), str)}}


class TokenRatios:
    """``policy_update``'s ``observe`` hook for one replay update: the replay-time log IS ratio
    of every sampled token, per drawn item and sample (None where the learner left a token out
    of the loss, e.g. ``--no-think-loss``)."""

    def __init__(self, trajs: Sequence[Any]) -> None:
        # The learner's rows in order: every sample with sampled tokens, trajectory by trajectory.
        self.rows = [(i, k, s) for i, t in enumerate(trajs) for k, s in enumerate(t.samples) if s.num_sampled > 0]
        self.out: list[list[list[float | None] | None]] = [[None] * len(t.samples) for t in trajs]
        self.next = 0
        self.seconds = 0.0  # time spent here, counted in the log's own time

    def __call__(self, batch: Any, logp: Any, behavior_logp: Any) -> None:
        t0 = time.perf_counter()
        try:
            self._take(batch, logp, behavior_logp)
        finally:
            self.seconds += time.perf_counter() - t0

    def _take(self, batch: Any, logp: Any, behavior_logp: Any) -> None:
        lr = (logp.float() - behavior_logp.float()).cpu().numpy()
        mask = batch.mask.cpu().numpy() > 0
        for j, sample in enumerate(batch.samples):
            while self.next < len(self.rows) and self.rows[self.next][2].token_ids is not sample.token_ids:
                self.next += 1  # a row the learner dropped (no sampled token left)
            if self.next >= len(self.rows):
                return
            i, k, orig = self.rows[self.next]
            self.next += 1
            pos = np.flatnonzero(orig.loss_mask > 0)
            pos = pos[pos < lr.shape[1]]
            self.out[i][k] = [round(float(v), 4) if m else None for v, m in zip(lr[j, pos], mask[j, pos])]


class ReplayLog:
    """Writes a run's replay log (module docstring). ``max_bytes``: the cap of the folder."""

    def __init__(self, run_dir: str | os.PathLike, *, max_bytes: int, resume_iteration: int | None = None,
                 header: dict[str, Any] | None = None, reporter: Any = None) -> None:
        self.dir = Path(run_dir) / FOLDER
        if self.dir.is_symlink():
            raise OSError(f"{self.dir} is a symbolic link: refusing to write through it")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.segment_bytes = max(1, self.max_bytes // SEGMENTS)
        self.header = {"type": "header", "format": FORMAT_VERSION, "age_edges": list(AGE_EDGES),
                       "max_bytes": self.max_bytes, **(header or {})}
        self.reporter = reporter  # learner.report.MetricsLogger: the replay figures go to its trackers
        if resume_iteration is None:
            for p in self.segments():
                p.unlink()
        else:
            self._truncate(resume_iteration)
        self._lines: list[bytes] = []
        self._draws: list[dict[str, Any]] = []
        self._fh = None
        self._size = 0
        self.seconds = 0.0  # this iteration's time in the log's own calls
        self.total_seconds = 0.0
        self.bytes_written = 0

    # -- files ---------------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        """The segment files, oldest first."""
        return segment_paths(self.dir.parent)

    def _truncate(self, iteration: int) -> None:
        """Remove every iteration after ``iteration`` (written after the checkpoint a run resumes)."""
        for path in self.segments():
            members = list(read_members(read_segment(path), what=str(path)))
            kept = [(raw, lines) for raw, lines in members if lines is not None
                    and not any(row.get("iteration", -1) > iteration for row in lines)]
            if len(kept) == len(members):
                continue
            if len(kept) <= 1:  # the header alone
                path.unlink()
                continue
            tmp = path.with_name(path.name + ".tmp")
            with open_nofollow(tmp, "wb", encoding=None) as fh:
                fh.write(b"".join(raw for raw, _ in kept))
            os.replace(tmp, path)

    def _open_segment(self) -> None:
        existing = self.segments()
        n = int(SEGMENT.match(existing[-1].name).group(1)) + 1 if existing else 0
        path = self.dir / f"seg-{n:06d}.jsonl.gz"
        self._fh = open_nofollow(path, "ab", encoding=None)
        self._size = 0
        self._write_member([json.dumps(self.header).encode()])
        for old in existing[: max(0, len(existing) - (SEGMENTS - 1))]:
            old.unlink()  # the cap: SEGMENTS segments at most, the oldest goes first

    def _write_member(self, lines: list[bytes]) -> None:
        comp = zlib.compressobj(6, zlib.DEFLATED, 31)
        data = comp.compress(b"\n".join(lines) + b"\n") + comp.flush()
        self._fh.write(data)
        self._fh.flush()
        self._size += len(data)
        self.bytes_written += len(data)

    # -- what train.py calls -------------------------------------------------------------------
    def added(self, it: int, step: float, ids: np.ndarray, records: Sequence[Any]) -> None:
        """Records entering the buffer at ``step`` under ``ids`` in iteration ``it`` (0-based;
        the log numbers iterations as ``metrics.jsonl`` does, from 1)."""
        t0 = time.perf_counter()
        for item_id, rec in zip(np.asarray(ids).tolist(), records):
            self._lines.append(json.dumps(episode_entry(item_id, it + 1, step, rec)).encode())
        self.seconds += time.perf_counter() - t0

    def observer(self, trajs: Sequence[Any]) -> TokenRatios:
        """The ``observe`` hook of the replay update about to train on ``trajs``."""
        self._ratios = TokenRatios(trajs)
        return self._ratios

    def drawn(self, it: int, step: float, sample: Any, stats: dict[str, Any], tau: float) -> None:
        """One replay update of iteration ``it`` (0-based): the drawn ``sample`` (a
        ``ReplaySample``, drawn at ``step`` with ``tau``) and the update's ``stats``."""
        t0 = time.perf_counter()
        ratios = getattr(self, "_ratios", None)
        row = {"type": "draw", "iteration": int(it) + 1, "k": len(self._draws), "step": float(step),
               "tau": _r(tau), "ids": np.asarray(sample.indices).tolist(),
               "ages": [_r(a) for a in sample.ages], "base": [_r(p) for p in sample.base_priorities],
               "fresh": [_r(f, 8) for f in sample.freshness], "prob": [_r(p, 10) for p in sample.probabilities],
               "weight": [_r(w) for w in sample.weights],
               "adv": [[_r(t.advantage if s.advantage is None else s.advantage) for s in t.samples]
                       for t in sample.items],
               "log_ratio": ratios.out if ratios is not None and ratios.next > 0 else None,
               "stats": _stats(stats)}
        self._ratios = None
        self._draws.append(row)
        self._lines.append(json.dumps(row).encode())
        self.seconds += time.perf_counter() - t0 + (ratios.seconds if ratios is not None else 0.0)

    def end_iteration(self, it: int, counters: Any, buffer: Any, on_policy: dict[str, Any],
                      tau_controller: Any = None) -> dict[str, Any]:
        """Write iteration ``it`` (0-based; one gzip member) and return its figures (also sent
        to the reporter's trackers)."""
        t0 = time.perf_counter()
        ages = buffer.age_stats(counters.global_step, AGE_EDGES)
        row = {"type": "iteration", "iteration": int(it) + 1, "step": int(counters.global_step),
               "episodes": int(counters.episodes), "tau": _r(buffer.tau), "auto_tau": tau_controller is not None,
               "drift": None if tau_controller is None or tau_controller.drift is None else _r(tau_controller.drift),
               "tau_signal": None if tau_controller is None else tau_controller.signal,
               "buffer": {"size": int(ages["size"]), "hist": ages.get("age_hist", [0] * len(AGE_EDGES)),
                          "mass": [_r(m, 8) for m in ages.get("age_mass", [0.0] * len(AGE_EDGES))]},
               "on_policy": _stats(on_policy), "log_seconds": round(self.seconds + time.perf_counter() - t0, 6)}
        self._lines.append(json.dumps(row).encode())
        if self._fh is None or self._size >= self.segment_bytes:
            if self._fh is not None:
                self._fh.close()
            self._open_segment()
        self._write_member(self._lines)
        figures = iteration_figures(row, self._draws)
        self._lines, self._draws = [], []
        if self.reporter is not None:
            self.reporter.report(figures["scalars"], counters.episodes, histograms=figures["histograms"])
        self.seconds += time.perf_counter() - t0
        self.total_seconds += self.seconds
        self.seconds = 0.0
        return figures

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class NullReplayLog:
    """What a run without replay (or with ``--replay-log-mb 0``) calls: nothing is written."""

    def added(self, *args: Any) -> None:
        pass

    def observer(self, trajs: Sequence[Any]) -> None:
        return None

    def drawn(self, *args: Any) -> None:
        pass

    def end_iteration(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def open_replay_log(run_dir: Path, *, replay: str, max_mb: float, resume_iteration: int | None,
                    header: dict[str, Any], reporter: Any = None) -> ReplayLog | NullReplayLog:
    """The replay log of a run: a :class:`ReplayLog`, or a :class:`NullReplayLog` without replay
    or with a cap of 0."""
    if replay == "none" or max_mb <= 0:
        return NullReplayLog()
    return ReplayLog(run_dir, max_bytes=int(max_mb * (1 << 20)), resume_iteration=resume_iteration,
                     header={"replay": replay, **header}, reporter=reporter)


def bucket_of(ages: Sequence[float], edges: Sequence[float] = AGE_EDGES) -> np.ndarray:
    """The histogram bucket of each age (``ReplayBuffer.age_stats``'s rule: the last is open)."""
    b = np.searchsorted(np.asarray(edges, dtype=np.float64), np.asarray(ages, dtype=np.float64), side="right") - 1
    return np.clip(b, 0, len(edges) - 1)


def iteration_figures(row: dict[str, Any], draws: list[dict[str, Any]]) -> dict[str, Any]:
    """The replay figures of one iteration, for the trackers: ``scalars`` (drawn-age mean and
    max, the share of the update's sampled tokens that came from replay, tau, drift, replay and
    on-policy gradient norm and clip fraction) and ``histograms`` (buffer and drawn ages)."""
    ages = [a for d in draws for a in d["ages"] if a is not None]
    replay_tokens = sum(d["stats"].get("tokens") or 0.0 for d in draws)
    on_tokens = row["on_policy"].get("tokens") or 0.0
    scalars: dict[str, float] = {"replay/tau": row["tau"], "replay/buffer_size": row["buffer"]["size"]}
    if row.get("drift") is not None:
        scalars["replay/drift"] = row["drift"]
    if ages:
        scalars.update({"replay/drawn_age_mean": float(np.mean(ages)), "replay/drawn_age_max": float(np.max(ages))})
    if replay_tokens + on_tokens > 0:
        scalars["replay/token_share"] = replay_tokens / (replay_tokens + on_tokens)
    for name, src in (("replay", [d["stats"] for d in draws]), ("on_policy", [row["on_policy"]])):
        for key in ("grad_norm", "clip_frac"):
            vals = [s[key] for s in src if s.get(key) is not None]
            if vals:
                scalars[f"replay/{name}_{key}"] = float(np.mean(vals))
    buffer_ages = np.repeat(np.asarray(AGE_EDGES, dtype=np.float64), row["buffer"]["hist"])
    histograms = {"replay/drawn_ages": np.asarray(ages, dtype=np.float64), "replay/buffer_ages": buffer_ages}
    return {"scalars": {k: float(v) for k, v in scalars.items() if v is not None}, "histograms": histograms}


def log_size(run_dir: str | os.PathLike) -> dict[str, float]:
    """Bytes on disk of a run's replay log, its iterations and bytes per iteration."""
    size = sum(p.lstat().st_size for p in segment_paths(run_dir))
    iterations = sum(1 for r in read_replay_log(run_dir) if r.get("type") == "iteration")
    return {"bytes": size, "iterations": iterations, "bytes_per_iteration": size / max(iterations, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m learner.replay_log", description="A run's replay log size.")
    parser.add_argument("run", help="a run folder")
    args = parser.parse_args(argv)
    try:
        s = log_size(args.run)
    except (UnsafeFileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.run}: {s['bytes']:,} bytes over {s['iterations']} iterations, "
          f"{s['bytes_per_iteration']:,.0f} bytes per iteration")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
