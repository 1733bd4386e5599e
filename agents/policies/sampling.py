"""The text-model sampler: a hand-written, batched, KV-cached loop (no HF ``generate``).

Per call: one prefill over the left-padded prompts with an attention mask and position ids,
then one forward per new token with the KV cache; each step samples from
``log_softmax(logits / T)`` in fp32 (argmax when greedy) and records the chosen token's
log-prob. Work that would be repeated is done once:

- identical prompts (a GRPO group's first turn) are prefilled once, their cache rows repeated;
- the prompts' common prefix (the task instructions) is prefilled once, its cache repeated;
- with a :class:`TurnKVCache` (``full`` context), a prompt that extends an earlier prompt plus
  its reply reuses that KV, so a turn prefills only its new tokens.

Every row computes what it would compute alone (masked padding between the reused prefix and
the new tokens, positions counted over real tokens only), so the behaviour log-probs match a
fresh forward over the record (fp32, ~1e-6); finished rows leave the batch.

A token is drawn (:func:`draw`) by ``torch.multinomial`` over a small vocabulary, and over a
larger one (more than :data:`RACE_VOCAB` entries: every real model) by the inverse of the
distribution function: one uniform variate per row against the float64 running sum of the
probabilities. ``torch.multinomial`` draws one exponential variate per vocabulary entry (the
exponential race), which on a 49k vocabulary was a fifth of a real model's rollout on the CPU.
Both draw from the same distribution; the token a given seed draws differs between them.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from agents.record import Generation


class DecodingModel(Protocol):
    """What the samplers need of a policy (:class:`agents.policies.policy.Policy` is one)."""

    model: torch.nn.Module
    pad_token_id: int
    eos_token_id: int
    cache_arg: str  # the forward's KV-cache keyword

    @property
    def device(self) -> torch.device: ...

    def sampling_logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """``log_softmax(logits / T)`` over the sampleable tokens."""

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [heads, tokens, dim]


class TurnKVCache:
    """KV of each sequence of the latest call (prompt + reply minus its last token), by token ids.

    Scope one to a single collect: it is only valid for the weights it was computed with.
    Only the latest call's sequences are kept (a full-context episode needs only its own last
    turn), which bounds memory to one batch.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], KV] = {}
        self._lengths: list[int] = []
        self._next: dict[tuple[int, ...], KV] = {}

    def lookup(self, row: tuple[int, ...]) -> tuple[int, KV | None]:
        """Longest stored sequence that is a proper prefix of ``row``: (its length, its KV)."""
        for n in self._lengths:
            if n < len(row):
                kv = self._entries.get(row[:n])
                if kv is not None:
                    return n, kv
        return 0, None

    def store(self, ids: tuple[int, ...], kv: KV) -> None:
        self._next[ids] = kv

    def finish_call(self) -> None:
        self._entries, self._next = self._next, {}
        self._lengths = sorted({len(k) for k in self._entries}, reverse=True)


def common_prefix_length(rows: Sequence[Sequence[int]], limit: int | None = None) -> int:
    """Length of the longest prefix shared by all ``rows``, at most ``limit`` (default: the
    shortest row)."""
    first = rows[0]
    n = max(0, min(len(r) for r in rows) if limit is None else limit)
    for r in rows[1:]:
        k = 0
        while k < n and r[k] == first[k]:
            k += 1
        n = k
    return n


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # older transformers: plain DynamicCache, no turn cache
    DynamicLayer = None


if DynamicLayer is not None:

    class _RoomyLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys/values are views of a buffer with spare room, so a new
        token is one slice write instead of a ``torch.cat`` of the whole cache (bit-identical
        attention; measured 12 -> 10 ms per 64-row decode step at 100 tokens, 32 -> 18 at 400).
        Methods that replace ``keys`` (reorder, repeat) are noticed and the buffer rebuilt."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._kbuf = self._vbuf = None
            n = self.keys.shape[-2] if self.keys.numel() else 0
            m = n + key_states.shape[-2]
            buf = self._kbuf
            if (buf is None or self.keys.data_ptr() != buf.data_ptr() or self.keys.shape[0] != buf.shape[0]
                    or m > buf.shape[-2]):
                room = m + max(64, m // 2)
                self._kbuf = key_states.new_empty(key_states.shape[:2] + (room, key_states.shape[-1]))
                self._vbuf = value_states.new_empty(value_states.shape[:2] + (room, value_states.shape[-1]))
                if n:
                    self._kbuf[:, :, :n] = self.keys
                    self._vbuf[:, :, :n] = self.values
            self._kbuf[:, :, n:m] = key_states
            self._vbuf[:, :, n:m] = value_states
            self.keys, self.values = self._kbuf[:, :, :m], self._vbuf[:, :, :m]
            return self.keys, self.values

    _PLAIN_LAYERS: tuple[type, ...] = (DynamicLayer, _RoomyLayer)
else:
    _PLAIN_LAYERS = ()


def _new_cache(model):
    """An empty ``DynamicCache`` for ``model``, with roomy layers where its layers are plain."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    layers = getattr(cache, "layers", None)
    if layers and all(type(layer) is DynamicLayer for layer in layers):
        cache.layers = [_RoomyLayer() for _ in layers]
    return cache


def _plain_layers(cache) -> list | None:
    """The cache's layers when each is a plain growing (non-sliding) layer, else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer) not in _PLAIN_LAYERS for layer in layers):
        return None
    return layers


@torch.inference_mode()
def sample_text(
    policy: DecodingModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    turn_cache: TurnKVCache | None = None,
) -> list[Generation]:
    """Sample a reply for every prompt (see the module docstring); rows stop at EOS (kept)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be non-empty")
    model, device = policy.model, policy.device
    cache_arg = policy.cache_arg
    unique: dict[tuple[int, ...], int] = {}
    inverse = [unique.setdefault(tuple(int(t) for t in p), len(unique)) for p in prompts]
    rows = list(unique)
    reused = [turn_cache.lookup(r) for r in rows] if turn_cache is not None else []
    cache = None
    if any(n for n, _ in reused):
        # Earlier turns' KV, each row's right-aligned in a [U, heads, region, dim] block.
        starts = [n for n, _ in reused]
        region = max(starts)
        cache = _new_cache(model)
        some = next(kv for _, kv in reused if kv is not None)
        for layer, (k0, v0) in enumerate(some):
            keys = k0.new_zeros((len(rows), k0.shape[0], region, k0.shape[2]))
            values = v0.new_zeros((len(rows), v0.shape[0], region, v0.shape[2]))
            for u, (n, kv) in enumerate(reused):
                if n:
                    keys[u, :, region - n:] = kv[layer][0]
                    values[u, :, region - n:] = kv[layer][1]
            cache.update(keys, values, layer)
    else:
        region = common_prefix_length(rows, limit=min(len(r) for r in rows) - 1)
        starts = [region] * len(rows)
    width = max(len(r) - s for r, s in zip(rows, starts))
    ids = torch.full((len(rows), width), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), region + width), dtype=torch.long)
    for u, (r, s) in enumerate(zip(rows, starts)):
        mask[u, region - s: region] = 1
        ids[u, width - (len(r) - s):] = torch.as_tensor(r[s:], dtype=torch.long)
        mask[u, region + width - (len(r) - s):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    was_training = model.training
    model.eval()
    try:
        if cache is None:
            cache = _new_cache(model)
            if region:
                prefix = torch.as_tensor(rows[0][:region], dtype=torch.long, device=device)[None]
                model(input_ids=prefix, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
                cache.batch_repeat_interleave(len(rows))
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions[:, region:],
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        cache, logits, mask, _ = expand_unique(out, mask, inverse)
        position = mask.sum(-1)  # next token's position
        layers = _plain_layers(cache) if turn_cache is not None else None

        def keep_kv(which: torch.Tensor, row: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor, step: int) -> None:
            """Store the KV of finished rows ``which`` (prompt + reply but its last token)."""
            if layers is None:
                return
            for b in which.tolist():
                p = int(row[b])
                valid = mask[b].nonzero().squeeze(-1)
                kv = [(layer.keys[b][:, valid].clone(), layer.values[b][:, valid].clone()) for layer in layers]
                turn_cache.store(rows[inverse[p]] + tuple(tokens[p, :step].tolist()), kv)

        return decode_rows(policy, cache, logits, mask, position, max_new_tokens=max_new_tokens,
                           temperature=temperature, greedy=greedy, on_finished=keep_kv)
    finally:
        model.train(was_training)
        if turn_cache is not None:
            turn_cache.finish_call()


def expand_unique(out, mask: torch.Tensor, inverse: Sequence[int]):
    """From the prefill of the distinct prompts to one row per prompt of the batch.

    ``inverse[b]`` is the distinct prompt of batch row ``b``. Returns the cache (rows repeated
    where prompts repeat), the next-token logits and attention mask per batch row, and the index.
    """
    cache = _cache_of(out)
    index = torch.as_tensor(inverse, dtype=torch.long, device=mask.device)
    if len(index) > out.logits.shape[0]:
        cache.reorder_cache(index)
    return cache, out.logits[index, -1], mask[index], index


#: Vocabularies up to this size are drawn from by ``torch.multinomial`` (the embedded models'
#: few hundred tokens, whose seeded runs it keeps); larger ones by the inverse distribution function.
RACE_VOCAB = 4096


def draw(logp: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logp`` [n, V] (log-probabilities, ``-inf`` for tokens that cannot
    be drawn), from the global torch generator."""
    if logp.shape[-1] <= RACE_VOCAB:
        return torch.multinomial(logp.exp(), 1).squeeze(-1)
    cdf = torch.cumsum(logp.exp(), dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    # strictly below the total, so the first entry whose running sum passes it has probability > 0
    u = torch.minimum(torch.rand(total.shape, dtype=torch.float64, device=logp.device) * total,
                      torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def decode_rows(
    policy: DecodingModel,
    cache,
    logits: torch.Tensor,
    mask: torch.Tensor,
    position: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    position_ids: Callable[[torch.Tensor], torch.Tensor] = lambda pos: pos[:, None],
    on_finished: Callable[..., None] | None = None,
) -> list[Generation]:
    """The decode loop shared by the text and vision samplers.

    ``logits`` [n, V] are each row's next-token logits after its prompt, ``mask`` its attention
    mask over ``cache`` and ``position`` its next token's position (``position_ids`` maps it to
    the model's layout, e.g. three rope axes). One cached forward per token; a row leaves the
    batch at EOS (kept in the reply). ``on_finished(which, row, mask, tokens, step)`` sees the
    batch rows that just finished, before they leave.
    """
    model, device, cache_arg = policy.model, policy.device, policy.cache_arg
    n = logits.shape[0]
    tokens = torch.full((n, max_new_tokens), policy.pad_token_id, dtype=torch.long, device=device)
    lps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((n,), max_new_tokens, dtype=torch.long, device=device)
    row = torch.arange(n, device=device)  # batch row -> prompt index
    for step in range(max_new_tokens):
        logp = policy.sampling_logprobs(logits, temperature)
        if not bool(torch.isfinite(logp).any(-1).all()):
            raise FloatingPointError("the policy's next-token distribution is not finite (are its weights finite?)")
        tok = logp.argmax(-1) if greedy else draw(logp)
        tokens[row, step] = tok
        lps[row, step] = logp.gather(-1, tok[:, None]).squeeze(-1)
        done = tok == policy.eos_token_id
        last = step + 1 == max_new_tokens
        if last or bool(done.any()):
            lengths[row[done]] = step + 1
            if on_finished is not None:  # at the last step every remaining row finishes
                finished = torch.arange(len(row), device=device) if last else done.nonzero().squeeze(-1)
                on_finished(finished, row, mask, tokens, step)
            if last:
                break
            keep = (~done).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            cache.reorder_cache(keep)
            row, tok, mask, position = row[keep], tok[keep], mask[keep], position[keep]
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=position_ids(position),
                       use_cache=True, **{cache_arg: cache}).logits[:, -1]
        position = position + 1
    tokens, lps, lengths = tokens.cpu().tolist(), lps.cpu().tolist(), lengths.cpu().tolist()
    return [Generation(t[:k], lp[:k], t[k - 1] == policy.eos_token_id) for t, lp, k in zip(tokens, lps, lengths)]
