"""Reading a run's replay log for the viewer: the replay page's figures and replayed episodes.

``train.py`` writes ``<run>/replay_log/seg-NNNNNN.jsonl.gz`` (``learner/replay_log.py`` documents
the format): gzip members of JSON lines, one member per iteration, rows of type ``header``,
``episode`` (a record entering the buffer under its item id), ``draw`` (one replay update: the
drawn ids with their ages, base priorities, freshness factors, sampling probabilities, IS
weights, advantages, token log IS ratios and the update's statistics) and ``iteration`` (the
buffer's age histogram, tau, drift, the on-policy update's statistics).

Read as untrusted input, like every run file, by :mod:`agents.runfolder`'s segment reader (the
learner's too), within the viewer's tighter bounds: only regular segment files inside the
viewer's root, each at most :data:`MAX_SEGMENT_BYTES`, decompressed to at most
:data:`MAX_TEXT_BYTES` per member, :data:`MAX_SEGMENT_TEXT_BYTES` (and ``MAX_RATIO`` times the
file) per segment, both checked while decompressing, one member held at a time, and
:data:`MAX_LOG_TEXT_BYTES` per run (newest segments first; older ones beyond that are left out
and said so), lines parsed with bounded depth; a torn last member (a run still writing or
killed) is skipped and said so. Each segment's summary is cached until the file changes, so a
page polling a live run re-reads only the segment being written. Episode text and token ratios
are not kept in memory: an episode page re-reads the members that hold them.
"""

from __future__ import annotations

import math
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agents.record import Sample, Trajectory, Turn
from agents.runfolder import REPLAY_LOG, Members, member_rows, read_segment, segment_paths
from agents.safeio import UnsafeFileError, inside
from agents.view.runs import ViewError

MAX_SEGMENT_BYTES = 256 << 20
MAX_TEXT_BYTES = 64 << 20
#: What one segment's members may decompress to in all, and at most ``agents.runfolder.MAX_RATIO``
#: times the file (at least 64 MB): a 1.3 MB segment of 40 gzip members of 32 MB each was read whole.
MAX_SEGMENT_TEXT_BYTES = 256 << 20
MAX_LOG_TEXT_BYTES = 1 << 30
#: The loss's age buckets of the IS ESS (``learner.loss.AGE_BUCKETS``), in order.
ESS_BUCKETS = ("0", "1-2", "3-8", "9+")
#: The most replayed episodes the replay page lists.
TOP_EPISODES = 20
_cache_lock = threading.Lock()
_segment_cache: dict[Path, tuple[tuple[float, int], "Segment"]] = {}
_SEGMENT_CACHE_MAX = 64


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _nums(xs: Any) -> list[float | None]:
    return [_num(x) for x in xs] if isinstance(xs, list) else []


@dataclass
class Segment:
    """What one segment holds, without the bulky parts: members' spans, iteration rows, draws
    (less advantages and token ratios) and an index of episodes."""

    path: Path
    members: list[tuple[int, int]] = field(default_factory=list)  # (offset, length) of each whole member
    header: dict[str, Any] = field(default_factory=dict)
    iterations: list[dict[str, Any]] = field(default_factory=list)
    draws: list[dict[str, Any]] = field(default_factory=list)  # each with "_member": its member index
    episodes: dict[int, dict[str, Any]] = field(default_factory=dict)  # id -> summary with "_member"
    problems: list[str] = field(default_factory=list)
    text_bytes: int = 0


def segment_summary(path: Path, root: Path) -> Segment:
    """A segment's summary, cached until the file changes."""
    st = os.lstat(path)
    key = (st.st_mtime, st.st_size)
    with _cache_lock:
        hit = _segment_cache.get(path)
        if hit and hit[0] == key:
            return hit[1]
    seg = Segment(path)
    if not stat.S_ISREG(st.st_mode):
        seg.problems.append(f"{path.name} is not a regular file (a link?): it is not read")
        return seg
    try:
        data = read_segment(path, root=root, max_bytes=MAX_SEGMENT_BYTES)
    except (OSError, UnsafeFileError) as exc:
        seg.problems.append(str(exc))
        return seg
    members = Members(data, max_text=MAX_SEGMENT_TEXT_BYTES, max_member=MAX_TEXT_BYTES)
    for m, member in enumerate(members):
        seg.members.append((member.offset, member.length))
        for row in member_rows(member.text, path.name):
            kind = row.get("type")
            if kind == "header":
                seg.header = row
            elif kind == "iteration":
                seg.iterations.append(row)
            elif kind == "draw" and isinstance(row.get("ids"), list):
                seg.draws.append({**{k: v for k, v in row.items() if k not in ("adv", "log_ratio")}, "_member": m})
            elif kind == "episode" and isinstance(row.get("id"), int):
                seg.episodes[row["id"]] = {"id": row["id"], "iteration": row.get("iteration"), "seed": row.get("seed"),
                                           "return": _num(row.get("return")), "success": bool(row.get("success")),
                                           "group": row.get("group"), "_member": m}
        del member
    seg.text_bytes = members.text_bytes
    if members.problem:
        seg.problems.append(f"{REPLAY_LOG}/{path.name} {members.problem}")
    del data, members
    with _cache_lock:
        _segment_cache[path] = (key, seg)
        while len(_segment_cache) > _SEGMENT_CACHE_MAX:
            _segment_cache.pop(next(iter(_segment_cache)))
    return seg


def reread_member(seg: Segment, m: int, root: Path) -> list[dict[str, Any]]:
    """Every row of member ``m`` of a segment (re-read from the file)."""
    offset, length = seg.members[m]
    try:
        data = read_segment(seg.path, root=root, max_bytes=MAX_SEGMENT_BYTES)[offset: offset + length]
    except (OSError, UnsafeFileError) as exc:
        raise ViewError(f"the replay log changed while it was read ({exc}): reload the page") from None
    members = Members(data, max_text=MAX_TEXT_BYTES, max_member=MAX_TEXT_BYTES)
    member = next(iter(members), None)
    if member is None or member.length != length:
        raise ViewError(f"the replay log changed while it was read ({seg.path.name} {members.problem or 'moved'}): "
                        "reload the page")
    return member_rows(member.text, seg.path.name)


@dataclass
class ReplayLog:
    """A run's replay log as the viewer reads it."""

    segments: list[Segment] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    bytes: int = 0

    @property
    def header(self) -> dict[str, Any]:
        return next((s.header for s in reversed(self.segments) if s.header), {})

    @property
    def iterations(self) -> list[dict[str, Any]]:
        return [r for s in self.segments for r in s.iterations]

    @property
    def draws(self) -> list[dict[str, Any]]:
        return [d for s in self.segments for d in s.draws]

    def episode_index(self) -> dict[int, tuple[Segment, dict[str, Any]]]:
        return {i: (s, e) for s in self.segments for i, e in s.episodes.items()}


def read_log(run_dir: Path, root: Path) -> ReplayLog | None:
    """A run's replay log (None where the run has none)."""
    folder = run_dir / REPLAY_LOG
    if not folder.is_dir() or folder.is_symlink() or not inside(folder, root):
        return None
    log = ReplayLog()
    text = 0
    for path in reversed(segment_paths(run_dir)):  # newest first, within the bound on text
        seg = segment_summary(path, root)
        if text + seg.text_bytes > MAX_LOG_TEXT_BYTES and log.segments:
            log.problems.append(f"the replay log is larger than the {MAX_LOG_TEXT_BYTES:,} bytes of text the viewer "
                                f"reads: its oldest segments are left out")
            break
        text += seg.text_bytes
        log.segments.insert(0, seg)
        log.problems[:0] = seg.problems
        try:
            log.bytes += os.lstat(path).st_size
        except OSError:
            pass
    return log


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def bucket_of(age: float, edges: list[float]) -> int:
    """The histogram bucket of an age (``ReplayBuffer.age_stats``'s rule: the last is open)."""
    b = int(np.searchsorted(np.asarray(edges, dtype=np.float64), age, side="right")) - 1
    return min(max(b, 0), len(edges) - 1)


DEFAULT_AGE_EDGES = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def _age_edges(log: ReplayLog) -> list[float]:
    """The header's ``age_edges``: 1 to 64 finite numbers, increasing; otherwise the default
    edges, and the log's problems say why."""
    raw = log.header.get("age_edges")
    if raw is None:
        return [float(e) for e in DEFAULT_AGE_EDGES]
    edges = raw if isinstance(raw, list) and 1 <= len(raw) <= 64 else None
    if edges is not None and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in edges):
        values = [float(e) for e in edges]
        if all(math.isfinite(v) for v in values) and all(a < b for a, b in zip(values, values[1:])):
            return values
    problem = (f"the replay log's header has age_edges {_clip(raw)}, not 1 to 64 increasing numbers: "
               "the default edges are shown")
    if problem not in log.problems:
        log.problems.append(problem)
    return [float(e) for e in DEFAULT_AGE_EDGES]


def _clip(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def figures(log: ReplayLog) -> dict[str, Any]:
    """What the replay page plots, per logged iteration (each list is aligned with
    ``iterations``): the buffer's age histogram and sampling mass, the drawn items' age
    histogram (same edges), the replay updates' IS ESS per age bucket (the mean over the
    iteration's updates, as ``metrics.jsonl``'s ``ess/age_*``), the share of the iteration's
    trained tokens that came from replay, tau and the fitted drift, and gradient norm and clip
    fraction of replay and on-policy updates; plus the most replayed episodes."""
    edges = _age_edges(log)
    draws_by_it: dict[int, list[dict[str, Any]]] = {}
    for d in log.draws:
        if isinstance(d.get("iteration"), int):
            draws_by_it.setdefault(d["iteration"], []).append(d)
    its = [r for r in log.iterations if isinstance(r.get("iteration"), int)]
    out: dict[str, Any] = {"edges": edges, "iterations": [], "buffer_hist": [], "buffer_mass": [], "drawn_hist": [],
                           "ess": {b: [] for b in ESS_BUCKETS}, "token_share": [], "tau": [], "drift": [],
                           "drift_measured": [], "grad_norm": {"replay": [], "on_policy": []},
                           "clip_frac": {"replay": [], "on_policy": []}, "draws": [], "log_seconds": []}
    for row in its:
        it = row["iteration"]
        draws = draws_by_it.get(it, [])
        buf = row.get("buffer") if isinstance(row.get("buffer"), dict) else {}
        out["iterations"].append(it)
        out["buffer_hist"].append([int(v) if isinstance(v, int) else 0 for v in (buf.get("hist") or [])][: len(edges)])
        out["buffer_mass"].append(_nums(buf.get("mass"))[: len(edges)])
        hist = [0] * len(edges)
        for d in draws:
            for a in _nums(d.get("ages")):
                if a is not None:
                    hist[bucket_of(a, edges)] += 1
        out["drawn_hist"].append(hist)
        stats = [d.get("stats") if isinstance(d.get("stats"), dict) else {} for d in draws]
        on = row.get("on_policy") if isinstance(row.get("on_policy"), dict) else {}
        for b in ESS_BUCKETS:
            out["ess"][b].append(_mean([_num(s.get(f"ess/age_{b}")) for s in stats]))
        replay_tokens = sum(_num(s.get("tokens")) or 0.0 for s in stats)
        on_tokens = _num(on.get("tokens")) or 0.0
        out["token_share"].append(replay_tokens / (replay_tokens + on_tokens) if replay_tokens + on_tokens > 0 else None)
        out["tau"].append(_num(row.get("tau")))
        out["drift"].append(_num(row.get("drift")))
        out["drift_measured"].append(_mean([_num(s.get("drift_per_step")) for s in stats]))
        for key in ("grad_norm", "clip_frac"):
            out[key]["replay"].append(_mean([_num(s.get(key)) for s in stats]))
            out[key]["on_policy"].append(_num(on.get(key)))
        out["draws"].append(len(draws))
        out["log_seconds"].append(_num(row.get("log_seconds")))
    out["auto_tau"] = bool(its and its[-1].get("auto_tau"))
    out["tau_signal"] = its[-1].get("tau_signal") if its else None
    # Episodes: how often each was drawn.
    times: dict[int, list[float]] = {}
    for d in log.draws:
        for i, a in zip(d.get("ids") or [], _nums(d.get("ages"))):
            if isinstance(i, int):
                times.setdefault(i, []).append(a)
    index = log.episode_index()
    top = sorted(times.items(), key=lambda kv: (-len(kv[1]), kv[0]))[:TOP_EPISODES]
    out["top"] = [{"id": i, "times": len(ages), "ages": ages,
                   **({k: v for k, v in index[i][1].items() if not k.startswith("_")} if i in index else {})}
                  for i, ages in top]
    out["episodes_logged"] = len(index)
    out["episodes_replayed"] = sum(1 for i in times if i in index)
    out["header"] = {k: v for k, v in log.header.items() if k != "type"}
    out["bytes"] = log.bytes
    out["bytes_per_iteration"] = log.bytes / len(its) if its else None
    return out


# -- one logged episode -------------------------------------------------------------------------
@dataclass
class ReplayView:
    """One replay update that drew an episode (once per draw: a batch may draw it twice)."""

    iteration: int
    k: int
    step: float
    age: float | None
    base: float | None
    freshness: float | None
    probability: float | None
    weight: float | None
    tau: float | None
    advantages: list[float | None]  # per sample, the advantage the update used
    log_ratios: list[list[float | None] | None] | None  # per sample, per sampled token


def episode(log: ReplayLog, item_id: int, root: Path) -> tuple[Trajectory, dict[str, Any], list[ReplayView]]:
    """A logged episode as a record (prompt tokens and images are not logged: each sample holds
    its sampled tokens, runs separated by an unsampled 0), its log row and every replay of it."""
    index = log.episode_index()
    if item_id not in index:
        first = min(index) if index else None
        raise ViewError(f"no episode {item_id} in this run's replay log"
                        + (f" (it holds ids {first} to {max(index)})" if index else " (it holds none)"), status=404)
    seg, summary = index[item_id]
    row = next((r for r in reread_member(seg, summary["_member"], root)
                if r.get("type") == "episode" and r.get("id") == item_id), None)
    if row is None:
        raise ViewError(f"episode {item_id} is no longer in the replay log: reload the page", status=404)
    rec = episode_record(row)
    replays: list[ReplayView] = []
    cache: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for s in log.segments:
        for d in s.draws:
            ids = d.get("ids") or []
            if item_id not in ids:
                continue
            key = (id(s), d["_member"])
            if key not in cache:
                cache[key] = reread_member(s, d["_member"], root)
            full = next((r for r in cache[key] if r.get("type") == "draw" and r.get("iteration") == d.get("iteration")
                         and r.get("k") == d.get("k")), {})
            for pos, i in enumerate(ids):
                if i != item_id:
                    continue

                def at(name: str, p: int = pos) -> float | None:
                    values = d.get(name) or []
                    return _num(values[p]) if p < len(values) else None

                advs = (full.get("adv") or [])
                ratios = full.get("log_ratio")
                replays.append(ReplayView(
                    iteration=int(d.get("iteration", 0)), k=int(d.get("k", 0)), step=_num(d.get("step")) or 0.0,
                    age=at("ages"), base=at("base"), freshness=at("fresh"), probability=at("prob"), weight=at("weight"),
                    tau=_num(d.get("tau")), advantages=_nums(advs[pos]) if pos < len(advs) else [],
                    log_ratios=ratios[pos] if isinstance(ratios, list) and pos < len(ratios) else None))
    return rec, row, replays


def episode_record(row: dict[str, Any]) -> Trajectory:
    """A log ``episode`` row as a :class:`~agents.record.Trajectory` the episode page shows."""
    turns = []
    for t in row.get("turns") or []:
        if not (isinstance(t, list) and len(t) >= 4):
            raise ViewError("a malformed episode in the replay log")
        turns.append(Turn(str(t[0]), str(t[1]), _num(t[2]) or 0.0, bool(t[3])))
    samples = []
    for s in row.get("samples") or []:
        ids, lps = s.get("ids") or [], s.get("lp") or []
        tok, mask, lp = [], [], []
        for run_ids, run_lp in zip(ids, lps):
            tok += [0] + [int(i) for i in run_ids if isinstance(i, int)]
            mask += [0] + [1] * len(run_ids)
            lp += [0.0] + [float(v) if isinstance(v, (int, float)) else 0.0 for v in run_lp]
        n = min(len(tok), len(mask), len(lp))
        samples.append(Sample(tok[:n], mask[:n], lp[:n], advantage=_num(s.get("adv"))))
    end = row.get("end") if isinstance(row.get("end"), dict) else {}
    return Trajectory(env_id=str(row.get("env_id", "")), seed=int(row.get("seed") or 0), group_id=int(row.get("group") or 0),
                      turns=turns, samples=samples, episode_return=_num(row.get("return")) or 0.0,
                      success=bool(row.get("success")), policy_version=int(row.get("policy_version") or 0),
                      advantage=_num(row.get("advantage")) or 0.0, context=str(row.get("context", "window:0")),
                      truncated=bool(row.get("truncated")), info={k: str(v) for k, v in end.items()})
