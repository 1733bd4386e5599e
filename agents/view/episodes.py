"""Trajectory records as a page shows them: episodes filtered by outcome, and one episode turn by
turn (observation text and image, the reply's tokens with their behaviour log-probs, reward,
validity and advantage).

Records are read with :func:`agents.record.load_records` (a regular ``records.jsonl`` of at most
:data:`MAX_RECORDS_BYTES`, images only from regular files inside the records folder, bounded in
bytes and pixels) and kept in memory per folder until the file changes; a record whose fields
have the wrong types is refused as a whole. Token text needs the tokenizer that sampled the ids;
it is loaded from a local model folder once and cached (never from the hub, never running a
folder's code; ids are shown when none can be loaded).
"""

from __future__ import annotations

import io
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from agents.record import Sample, Trajectory, load_records
from agents.view.runs import ViewError

logger = logging.getLogger(__name__)

#: How many records folders stay in memory (the oldest read is dropped first).
RECORDS_CACHE_FOLDERS = 16
#: The largest ``records.jsonl`` the viewer reads.
MAX_RECORDS_BYTES = 512 << 20
#: ``/image?scale=`` is a whole number in this range, and an enlarged image has at most
#: :data:`MAX_SCALED_PIXELS` pixels.
SCALE_RANGE = (1, 16)
MAX_SCALED_PIXELS = 16 << 20
_records_lock = threading.Lock()
_records_cache: dict[Path, tuple[tuple[float, int], list[Trajectory]]] = {}
_tokenizer_lock = threading.Lock()
_tokenizers: dict[str, Any] = {}


def records_in(folder: Path) -> list[Trajectory]:
    """The records of ``folder/records.jsonl``, cached until the file changes; a missing or
    corrupt file raises :class:`ViewError` with what is wrong."""
    import os
    import stat

    path = folder / "records.jsonl"
    try:
        st = os.lstat(path)
    except OSError:
        raise ViewError(f"no records.jsonl in {folder.name}: this evaluation has not been saved", status=404) from None
    if not stat.S_ISREG(st.st_mode):
        raise ViewError(f"the records.jsonl in {folder.name} is not a regular file (a link, FIFO or device): "
                        "it is not read")
    if st.st_size > MAX_RECORDS_BYTES:
        raise ViewError(f"the records.jsonl in {folder.name} is {st.st_size:,} bytes, more than the "
                        f"{MAX_RECORDS_BYTES:,} the viewer reads")
    key = (st.st_mtime, st.st_size)
    with _records_lock:
        hit = _records_cache.get(folder)
        if hit and hit[0] == key:
            return hit[1]
    try:
        records = load_records(folder)
        for rec in records:
            _check_record(rec)
    except (ValueError, KeyError, TypeError, OSError, RecursionError, OverflowError) as exc:
        raise ViewError(f"the records in {folder.name} cannot be read: {exc}") from exc
    with _records_lock:
        _records_cache[folder] = (key, records)
        while len(_records_cache) > RECORDS_CACHE_FOLDERS:
            _records_cache.pop(next(iter(_records_cache)))
    return records


def _check_record(rec: Trajectory) -> None:
    """ValueError unless a record's fields have the types the pages use (a hand-edited or
    hostile record is refused as a whole instead of failing halfway through a page)."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) or isinstance(x, np.floating)

    ok = (isinstance(rec.env_id, str) and isinstance(rec.info, dict) and number(rec.episode_return)
          and number(rec.advantage) and isinstance(rec.turns, list) and isinstance(rec.samples, list)
          and all(isinstance(t.observation, str) and isinstance(t.reply, str) and number(t.reward)
                  and (t.image_index is None or isinstance(t.image_index, int)) for t in rec.turns)
          and all(s.advantage is None or number(s.advantage) for s in rec.samples)
          and isinstance(rec.info.get("typed_turns", []) or [], list))
    if not ok:
        raise ValueError(f"a record of {str(rec.env_id)[:60]!r} has fields of the wrong type")
    rec.episode_return, rec.advantage = float(rec.episode_return), float(rec.advantage)


@dataclass
class EpisodeFilter:
    """Which episodes a list shows: by success and a return range (None: no bound)."""

    success: str = "any"  # any | yes | no
    min_return: float | None = None
    max_return: float | None = None

    @classmethod
    def parse(cls, params: dict[str, str]) -> "EpisodeFilter":
        """From query parameters; a malformed number raises :class:`ViewError`."""
        success = (params.get("success") or "any").lower()
        if success not in ("any", "yes", "no"):
            raise ViewError(f"success must be any, yes or no, not {success!r}")

        def number(name: str) -> float | None:
            raw = (params.get(name) or "").strip()
            if not raw:
                return None
            try:
                value = float(raw)
            except ValueError:
                raise ViewError(f"{name.replace('_', ' ')} must be a number, not {raw!r}") from None
            if math.isnan(value):
                raise ViewError(f"{name.replace('_', ' ')} must be a number, not NaN")
            return value

        return cls(success, number("min_return"), number("max_return"))

    def keep(self, rec: Trajectory) -> bool:
        if self.success == "yes" and not rec.success:
            return False
        if self.success == "no" and rec.success:
            return False
        if self.min_return is not None and rec.episode_return < self.min_return:
            return False
        if self.max_return is not None and rec.episode_return > self.max_return:
            return False
        return True


def filter_episodes(records: Sequence[Trajectory], flt: EpisodeFilter) -> list[tuple[int, Trajectory]]:
    """``(index, record)`` of the records the filter keeps, in file order."""
    return [(n, r) for n, r in enumerate(records) if flt.keep(r)]


# -- tokens ------------------------------------------------------------------------------------
def load_tokenizer(folder: str | Path | None) -> Any | None:
    """The tokenizer saved in a model folder, cached; None (and a log line) if it cannot be loaded."""
    if folder is None or not Path(str(folder)).is_dir():  # a hub id is never looked up: nothing leaves the machine
        return None
    key = str(folder)
    with _tokenizer_lock:
        if key in _tokenizers:
            return _tokenizers[key]
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(key, local_files_only=True, trust_remote_code=False)
        except Exception as exc:  # any loading failure means: show ids instead of text
            logger.warning("no tokenizer from %s: %s", key, exc)
            tok = None
        _tokenizers[key] = tok
        return tok


@dataclass
class TokenView:
    """One sampled token: its id, its text and its behaviour log-probability."""

    id: int
    text: str
    logprob: float
    #: The replay-time log IS ratio ``log pi - log mu`` of this token in each replay of its
    #: episode (None where that update left it out of the loss); empty for episodes never replayed.
    log_ratios: list[float | None] = field(default_factory=list)

    @property
    def prob(self) -> float:
        return math.exp(self.logprob)

    @property
    def shown(self) -> str:
        """The text with line breaks, tabs and bare spaces made visible (a reply of newlines
        would otherwise be an empty tall box)."""
        if not self.text:
            return "\u2205"
        text = self.text.replace("\r", "\u240d").replace("\n", "\u21b5").replace("\t", "\u21e5")
        return text if text.strip(" ") else "\u2423" * len(text)

    @property
    def colour(self) -> str:
        """A background from red (p = 0) through yellow to green (p = 1)."""
        return f"hsl({120 * min(1.0, max(0.0, self.prob)):.0f}, 75%, 82%)"


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` runs where ``mask`` is 1."""
    out, start = [], None
    for i, m in enumerate(mask.tolist() + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def reply_spans(rec: Trajectory) -> list[tuple[Sample, int, int] | None]:
    """Per turn, where its reply's sampled tokens are: ``(sample, start, end)``, or None where the
    reply was not sampled (typed by hand) or the record's layout is not recognised.

    ``window:k`` records have one sample per turn whose last sampled run is that turn's reply;
    ``full`` records have one sample whose sampled runs are the replies in order.
    """
    typed = set(rec.info.get("typed_turns", []) or [])
    spans: list[tuple[Sample, int, int] | None] = [None] * len(rec.turns)
    if len(rec.samples) == len(rec.turns):
        for t, sample in enumerate(rec.samples):
            runs = _runs(sample.loss_mask)
            if runs and t not in typed:
                spans[t] = (sample, *runs[-1])
    elif len(rec.samples) == 1:
        runs = _runs(rec.samples[0].loss_mask)
        if len(runs) == len(rec.turns):
            spans = [(rec.samples[0], a, b) for a, b in runs]
    return spans


def token_views(sample: Sample, start: int, end: int, tokenizer: Any | None) -> list[TokenView]:
    """The tokens ``start..end`` of a sample with their text (``#id`` without a tokenizer)."""
    out = []
    for i in range(start, end):
        tid = int(sample.token_ids[i])
        if tokenizer is not None:
            text = tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        else:
            text = f"#{tid}"
        out.append(TokenView(tid, text, float(sample.behavior_logprobs[i])))
    return out


@dataclass
class TurnView:
    """One turn as shown: what the model saw and said, and what it earned."""

    index: int
    observation: str
    image_index: int | None
    reply: str
    reward: float
    valid: bool
    advantage: float
    typed: bool
    tokens: list[TokenView] = field(default_factory=list)

    @property
    def mean_logprob(self) -> float | None:
        return sum(t.logprob for t in self.tokens) / len(self.tokens) if self.tokens else None


def turn_views(rec: Trajectory, tokenizer: Any | None,
               log_ratios: Sequence[Sequence[Sequence[float | None] | None] | None] = ()) -> list[TurnView]:
    """Every turn of a record with its reply tokens and advantage (the sample's own, else the
    episode's). ``log_ratios``: per replay of the episode, per sample, the log IS ratio of each
    sampled token in order (the replay log's), attached to the tokens shown."""
    typed = set(rec.info.get("typed_turns", []) or [])
    out = []
    for t, (turn, span) in enumerate(zip(rec.turns, reply_spans(rec))):
        sample = rec.samples[t] if len(rec.samples) == len(rec.turns) else None
        advantage = sample.advantage if sample is not None and sample.advantage is not None else rec.advantage
        tokens = token_views(*span, tokenizer) if span is not None else []
        if span is not None and log_ratios:
            k = next(i for i, s in enumerate(rec.samples) if s is span[0])
            order = np.cumsum(span[0].loss_mask > 0) - 1  # position -> index among the sampled tokens
            for tok, pos in zip(tokens, range(span[1], span[2])):
                for per_sample in log_ratios:
                    values = per_sample[k] if per_sample is not None and k < len(per_sample) else None
                    j = int(order[pos])
                    tok.log_ratios.append(values[j] if values is not None and j < len(values) else None)
        out.append(TurnView(t, turn.observation, turn.image_index, turn.reply, turn.reward, turn.action_is_valid,
                            float(advantage), t in typed, tokens))
    return out


def png_bytes(image: np.ndarray, scale: int = 1) -> bytes:
    """An image array as PNG bytes, optionally enlarged by an integer factor (nearest neighbour,
    so small boards stay sharp); ``scale`` outside :data:`SCALE_RANGE`, or an enlarged image of
    more than :data:`MAX_SCALED_PIXELS` pixels, is a :class:`ViewError`."""
    from PIL import Image

    lo, hi = SCALE_RANGE
    if not lo <= scale <= hi:
        raise ViewError(f"scale must be a whole number from {lo} to {hi}, not {scale}")
    arr = np.asarray(image, dtype=np.uint8)
    if arr.ndim < 2 or arr.shape[0] * arr.shape[1] * scale * scale > MAX_SCALED_PIXELS:
        raise ViewError(f"an image of shape {arr.shape} enlarged {scale} times is too large to show")
    pil = Image.fromarray(arr)
    if scale > 1:
        pil = pil.resize((pil.width * scale, pil.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    pil.save(buf, format="PNG")
    return buf.getvalue()


def record_image(rec: Trajectory, k: int) -> np.ndarray:
    """Image ``k`` of a record, or :class:`ViewError` if there is none."""
    if not 0 <= k < len(rec.images):
        raise ViewError(f"this episode has no image {k} (it has {len(rec.images)})", status=404)
    return rec.images[k]
