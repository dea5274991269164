"""Log-probabilities of chosen tokens, computed in chunks of positions.

``log_softmax(logits).gather(target)`` materialises a full-vocabulary float32 tensor as large
as the logits (twice, under autograd: the result is kept for backward). Here each chunk of
positions computes ``logit[target] - logsumexp(logits)`` and keeps only the chosen tokens'
values, so the extra memory is one chunk's worth. Under autograd only the logits (no copy)
and one float per position are kept, and the backward also goes chunk by chunk.
"""

from __future__ import annotations

from typing import Any

import torch

# Positions per chunk are chosen so that one chunk holds about this many logits. A GPU
# pays a few kernel launches per chunk, so its chunks are larger (512 MB of float32).
DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 27}


def _chunk_positions(
    batch: int, vocab: int, chunk_size: int | None, device: torch.device | None = None
) -> int:
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be a positive int, got {chunk_size!r}")
        return chunk_size
    kind = "cuda" if device is not None and device.type == "cuda" else "cpu"
    return max(1, DEFAULT_CHUNK_ELEMENTS[kind] // max(1, batch * vocab))


class _ChosenLogprobs(torch.autograd.Function):
    """``logits[target] - logsumexp(logits)`` chunk by chunk, with a chunked backward.

    Saved for backward: the logits themselves (no copy) and the [B, T] log-normalisers; the
    backward writes ``grad * (onehot(target) - softmax)`` into one gradient buffer chunk by
    chunk, so no full-size temporary besides the gradient the caller needs anyway.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
        B, T = targets.shape  # the first T positions of logits (it may hold more)
        out = torch.empty((B, T), dtype=torch.float32, device=logits.device)
        lse = torch.empty((B, T), dtype=torch.float32, device=logits.device)
        for s in range(0, T, step):
            e = min(s + step, T)
            x = logits[:, s:e].float()
            lse[:, s:e] = torch.logsumexp(x, dim=-1)
            chosen = x.gather(-1, targets[:, s:e].unsqueeze(-1)).squeeze(-1)
            out[:, s:e] = chosen - lse[:, s:e]
        ctx.save_for_backward(logits, targets, lse)
        ctx.step = step
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        T, step = targets.shape[1], ctx.step
        grad[:, T:] = 0
        for s in range(0, T, step):
            e = min(s + step, T)
            g = grad_out[:, s:e].float().unsqueeze(-1)
            p = torch.exp(logits[:, s:e].float() - lse[:, s:e].unsqueeze(-1))
            chunk = p.mul_(-g)
            chunk.scatter_add_(-1, targets[:, s:e].unsqueeze(-1), g)
            grad[:, s:e] = chunk.to(grad.dtype)
        return grad, None, None


def chosen_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """``log p(targets[b, t])`` under ``logits[b, t]``: [B, T] float32 from logits
    [B, >= T, V] (positions past T are not used) and targets [B, T].

    ``chunk_size`` is the number of positions per chunk (default: about 16M logits a chunk
    on the CPU, 128M on a GPU).
    Differentiable with respect to ``logits``.
    """
    B, T = targets.shape
    if logits.ndim != 3 or logits.shape[0] != B or logits.shape[1] < T:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree"
        )
    step = _chunk_positions(B, logits.shape[2], chunk_size, logits.device)
    if T == 0:
        return logits.new_zeros((B, 0), dtype=torch.float32)
    return _ChosenLogprobs.apply(logits, targets.to(logits.device), step)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """Log-prob of each next token: [B, T-1] from logits [B, T, V] and ids [B, T]."""
    # The full logits go in (a [:, :-1] view would cost a full-size gradient copy).
    return chosen_token_logprobs(logits, input_ids[:, 1:], chunk_size)


@torch.no_grad()
def entropy_sum(
    logits: torch.Tensor, mask: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """Sum over ``mask`` of the entropy of ``logits`` [B, T, V] (mask [B, T]), chunked."""
    B, T, V = logits.shape
    step = _chunk_positions(B, V, chunk_size, logits.device)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for s in range(0, T, step):
        logp = torch.log_softmax(logits[:, s : s + step].float(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        total += (ent * mask[:, s : s + step].to(ent.device)).sum()
    return total
