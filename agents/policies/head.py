"""Log-probs of chosen tokens straight from the last hidden states: the LM head fused with the
log-softmax.

Scoring a batch the ordinary way runs the LM head (``logits = h @ W.T``, ``[N, V]``), turns the
logits into an fp32 copy divided by the temperature, takes its ``logsumexp`` and keeps one entry
per row; autograd then holds each of those ``[N, V]`` intermediates and builds as many again in
the backward pass (the fp32 gradient, a zeroed scatter target, the cast back). On a real
vocabulary (49k to 152k entries) that bookkeeping costs more than the LM head's matrix products.

:func:`head_logprobs` does the same arithmetic in one autograd node:

- forward: the logits in the compute dtype (one matrix product, kept for the backward pass as
  the ordinary path keeps them), then per row block of ~4M elements the fp32 ``logits / T``
  with the suppressed ids at ``-inf``, its ``logsumexp`` and the chosen entry; without a
  gradient the logits are made block by block and never held whole;
- backward: per row block ``g * (onehot - softmax) / T`` written over the kept logits in their
  dtype, then the two matrix products of the head's backward pass.

The values and gradients are those of ``log_softmax(h @ W.T / T)[target]`` under autocast,
taken the ordinary way (a test holds them equal); a row whose target is suppressed reports 0
and carries no gradient, as :meth:`agents.policies.policy.Policy.logprobs_of` does.
``benchmarks/head_bench.py`` measures the two ways side by side.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: Row blocks of the fp32 log-softmax hold about this many elements (16 MB of fp32: ~85 rows of a
#: 49k vocabulary, ~28 of 152k), small enough to stay in the CPU's caches.
BLOCK_ELEMENTS = 1 << 22


def _rows(vocab: int) -> int:
    return max(1, BLOCK_ELEMENTS // vocab)


def _scaled(logits: torch.Tensor, temperature: float, suppressed: Sequence[int]) -> torch.Tensor:
    """``logits / T`` in fp32 with the suppressed ids at ``-inf``; ``logits`` itself is never written."""
    out = logits.float()
    if temperature != 1.0:
        out = out / temperature
    if suppressed:
        out = out.clone() if out is logits else out
        out[:, suppressed] = float("-inf")
    return out


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, suppressed, dtype):  # noqa: D102
        h, w = hidden.to(dtype), weight.to(dtype)
        n, vocab = h.shape[0], w.shape[0]
        rows = _rows(vocab)
        out = torch.empty(n, dtype=torch.float32, device=h.device)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        keep = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        logits = h @ w.T if keep else None
        for s in range(0, n, rows):
            block = logits[s:s + rows] if keep else h[s:s + rows] @ w.T
            scaled = _scaled(block, temperature, suppressed)
            lse[s:s + rows] = torch.logsumexp(scaled, dim=-1)
            out[s:s + rows] = scaled.gather(-1, targets[s:s + rows, None])[:, 0] - lse[s:s + rows]
        finite = torch.isfinite(out)
        out = torch.where(finite, out, torch.zeros_like(out))
        if keep:
            ctx.save_for_backward(h, w, targets, lse, finite)
            ctx.logits = logits  # overwritten by its own gradient in backward: not a saved tensor
            ctx.settings = (temperature, suppressed, hidden.dtype, weight.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        h, w, targets, lse, finite = ctx.saved_tensors
        temperature, suppressed, hidden_dtype, weight_dtype = ctx.settings
        logits, ctx.logits = ctx.logits, None
        if logits is None:
            raise RuntimeError("head_logprobs: backward ran twice through the same graph")
        grad = torch.where(finite, grad.float(), torch.zeros_like(lse))
        rows = _rows(w.shape[0])
        for s in range(0, h.shape[0], rows):
            g = grad[s:s + rows, None]
            p = (_scaled(logits[s:s + rows], temperature, suppressed) - lse[s:s + rows, None]).exp_()
            p.mul_(-g).scatter_add_(-1, targets[s:s + rows, None], g)
            if temperature != 1.0:
                p.div_(temperature)
            logits[s:s + rows] = p  # the gradient of the logits, in their dtype
        grad_h = (logits @ w).to(hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_w = (logits.T @ h).to(weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  suppressed: Sequence[int] = ()) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T / T)[targets]`` in fp32, differentiable in ``hidden`` and
    ``weight``; hidden ``[..., H]``, weight ``[V, H]`` (an LM head without bias), targets ``[...]``.

    The product runs in the autocast dtype where autocast is on (as the head's ``Linear`` would),
    else in the weight's dtype. Suppressed ids are never chosen (``-inf``); a row whose target is
    one of them reports 0.
    """
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    shape = targets.shape
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    with torch.autocast(device_type, enabled=False):
        out = _HeadLogprobs.apply(flat_hidden, weight, flat_targets, float(temperature), list(suppressed), dtype)
    return out.reshape(shape)
