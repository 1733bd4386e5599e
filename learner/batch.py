"""From trajectory records to padded training tensors: the one record-to-batch step.

Every optimizer step of the project (pretraining, GRPO updates, replay updates) trains on
:class:`~agents.record.Sample` s, the per-turn (``window:k``) or per-episode (``full``) token
sequences of the records. :func:`make_batches` turns records, with their PER weights and ages,
into micro-batches once: the samples that hold sampled tokens, their images, the padded loss
mask and behaviour log-probs, and one advantage, weight and age per sample. The advantage is
the sample's own (turn-level credit, ``Sample.advantage``) where the record stores one, else
the trajectory's group-relative advantage. :func:`supervised_batches` does the same for plain
samples with a fixed target (pretraining: weight 1, advantage 1).

``num_tokens`` is the sampled-token count of the *whole* batch, so a loss summed over
micro-batches with that denominator equals the loss of the batch in one pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from agents.record import Sample, Trajectory


@dataclass
class Batch:
    """One micro-batch of training sequences, right-padded to its longest sample."""

    samples: list[Sample]
    images: list[list[np.ndarray]]  # per sample, its images in order
    mask: torch.Tensor  # [B, T] float32, 1 on sampled tokens
    behavior_logprobs: torch.Tensor  # [B, T] float32, log-probs stored at sampling time
    advantages: torch.Tensor  # [B]
    weights: torch.Tensor  # [B] PER weights (1 for fresh data)
    ages: torch.Tensor  # [B] optimizer steps since collection
    num_tokens: float  # sampled tokens of the whole batch (the token-mean denominator)

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def seq_tokens(self) -> int:
        """Tokens of every sequence, prompts included (the learner's work)."""
        return sum(len(s.token_ids) for s in self.samples)

    def to(self, device: torch.device | str) -> "Batch":
        """The batch with its tensors on ``device`` (the policy's); itself when they are there."""
        device = torch.device(device)
        if self.mask.device == device:
            return self
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in
                                            ("mask", "behavior_logprobs", "advantages", "weights", "ages")})


def pad_rows(rows: Sequence[np.ndarray], width: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Right-pad 1-D arrays with zeros into a ``[len(rows), width]`` tensor."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(np.asarray(r), dtype=dtype)
    return out


def masked(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero the log-probs of unsampled positions (prompt tokens may be -inf, e.g. image pads)."""
    return torch.where(mask > 0, logp, torch.zeros_like(logp))


@dataclass(frozen=True)
class MicroBatch:
    """How a batch is cut into forward/backward passes: at most ``samples`` sequences, and with
    ``tokens`` > 0 at most that many padded tokens (sequences x the longest one) a pass, a longer
    sequence alone. The loss is normalised by the whole batch's tokens, so the cut changes the
    memory a pass holds, not the update."""

    samples: int = 256
    tokens: int = 0


def _chunks(rows: list, size: "int | MicroBatch", length=None) -> list[list]:
    """``rows`` in order, cut by ``size``: a sample count, or a :class:`MicroBatch` with a token
    cap too (``length(row)``: the row's sequence length)."""
    cap = size if isinstance(size, MicroBatch) else MicroBatch(int(size))
    n = max(1, cap.samples)
    if cap.tokens <= 0:
        return [rows[i : i + n] for i in range(0, len(rows), n)]
    out: list[list] = []
    chunk: list = []
    width = 0
    for row in rows:
        w = max(width, length(row))
        if chunk and (len(chunk) >= n or (len(chunk) + 1) * w > cap.tokens):
            out.append(chunk)
            chunk, w = [], length(row)
        chunk.append(row)
        width = w
    if chunk:
        out.append(chunk)
    return out


def drop_span(sample: Sample, open_id: int, close_id: int) -> Sample:
    """``sample`` with every sampled span from ``open_id`` through the next ``close_id``
    (e.g. ``<think>`` ... ``</think>``) out of the loss mask. A span that is never closed is
    kept: such a reply has no answer, and its tokens must carry the format penalty (dropping
    them would leave a reply that never closes its think tag with no gradient at all, so
    nothing would train the policy out of it)."""
    ids = np.asarray(sample.token_ids)
    opens = np.flatnonzero((ids == open_id) & (sample.loss_mask > 0))
    if not len(opens):
        return sample
    mask = sample.loss_mask.copy()
    for start in opens:
        closes = np.flatnonzero(ids[start:] == close_id)
        if len(closes):
            mask[start : start + closes[0] + 1] = 0
    return dataclasses.replace(sample, loss_mask=mask, behavior_logprobs=np.where(mask > 0, sample.behavior_logprobs, 0.0))


def make_batches(trajs: Sequence[Trajectory], weights: Sequence[float] | np.ndarray | None = None,
                 ages: Sequence[float] | np.ndarray | None = None, micro_batch: int = 256,
                 skip_span: tuple[int, int] | None = None, part: tuple[int, int] | None = None) -> list[Batch]:
    """Micro-batches of every sample with sampled tokens, each carrying its trajectory's PER
    weight and age and its advantage (the sample's own where stored, else the trajectory's).
    ``skip_span``: (open, close) token ids whose spans get no loss (:func:`drop_span`).
    ``part``: (rank, world) of a sharded learner: this rank's samples alone (every
    ``world``-th, in order), with the whole batch's token count as ``num_tokens``."""
    n = len(trajs)
    weights = np.ones(n) if weights is None else np.asarray(weights, dtype=np.float64)
    ages = np.zeros(n) if ages is None else np.asarray(ages, dtype=np.float64)
    rows = [(i, s) for i, t in enumerate(trajs) for s in t.samples if s.num_sampled > 0]
    if skip_span is not None:
        rows = [(i, s) for i, s in ((i, drop_span(s, *skip_span)) for i, s in rows) if s.num_sampled > 0]
    total = float(sum(s.num_sampled for _, s in rows))
    if part is not None:
        rows = rows[part[0]::part[1]]
    out = []
    for chunk in _chunks(rows, micro_batch, lambda row: len(row[1].token_ids)):
        samples = [s for _, s in chunk]
        width = max(len(s.token_ids) for s in samples)
        out.append(Batch(
            samples=samples,
            images=[[trajs[i].images[k] for k in s.image_ids] for i, s in chunk],
            mask=pad_rows([s.loss_mask for s in samples], width),
            behavior_logprobs=pad_rows([s.behavior_logprobs for s in samples], width),
            advantages=torch.tensor([trajs[i].advantage if s.advantage is None else s.advantage for i, s in chunk],
                                    dtype=torch.float32),
            weights=torch.tensor([float(weights[i]) for i, _ in chunk], dtype=torch.float32),
            ages=torch.tensor([float(ages[i]) for i, _ in chunk], dtype=torch.float32),
            num_tokens=total,
        ))
    return out


def supervised_batches(samples: Sequence[Sample], images: Sequence[Sequence[np.ndarray]] | None = None,
                       micro_batch: int = 256) -> list[Batch]:
    """Micro-batches of plain samples (pretraining targets): weight 1, advantage 1, age 0."""
    images = [[] for _ in samples] if images is None else images
    rows = [(s, list(im)) for s, im in zip(samples, images) if s.num_sampled > 0]
    total = float(sum(s.num_sampled for s, _ in rows))
    out = []
    for chunk in _chunks(rows, micro_batch, lambda row: len(row[0].token_ids)):
        part = [s for s, _ in chunk]
        width = max(len(s.token_ids) for s in part)
        ones = torch.ones(len(part))
        out.append(Batch(samples=part, images=[im for _, im in chunk], mask=pad_rows([s.loss_mask for s in part], width),
                         behavior_logprobs=pad_rows([s.behavior_logprobs for s in part], width), advantages=ones,
                         weights=ones.clone(), ages=torch.zeros(len(part)), num_tokens=total))
    return out


def batch_logprobs(policy, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` log-probs of the batch's sampled tokens under ``policy`` (0 elsewhere), through
    the shared-prefix pass of :mod:`learner.prefix` (differentiable)."""
    from learner.prefix import sampled_logprobs

    lp = sampled_logprobs(policy, batch.samples, batch.images, temperature)
    return masked(lp, batch.mask.to(lp.device))
