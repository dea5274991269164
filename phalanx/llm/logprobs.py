"""Log-probabilities of chosen tokens, without a full-vocabulary float32 copy of the logits.

``log_softmax(logits).gather(target)`` materialises a float32 tensor as large as the logits
(kept for backward under autograd) and, from bfloat16 logits, a float32 cast of them too.
Here the logits are read as the rows of a [positions, V] view and only the chosen tokens'
values are kept; under autograd only the logits themselves (no copy) are saved. Two kernels
compute the same values:

- ``"compiled"``: ``torch.compile`` fuses the forward into one reduction over each row
  (``logit[target] - logsumexp``, read straight from the model's dtype) and the backward into
  one pointwise pass writing ``g * (onehot(target) - softmax)`` in the logits' dtype. The
  logits are read twice and their gradient written once, with no temporary. The default on
  a GPU with Triton.
- ``"eager"``: stock ops over chunks of rows, each chunk's float32 temporaries bounded by
  ``logprob_chunk_size`` positions per row. The default elsewhere (compiling costs seconds
  per process, which short CPU runs and tests do not win back).

``logprob_settings`` sets the chunk size and kernel for the code it wraps (the policy worker
wraps its ``train`` and ``get_logprobs``, so the loss functions it calls use them too).
``entropy_sum`` (the losses' entropy metric) takes the same settings: compiled, one fused
pass over each counted row; eager, a float32 chunk at a time.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import importlib.util
import warnings
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.llm.policy_config import LOGPROB_KERNELS as KERNELS

# Positions per eager chunk are chosen so that one chunk holds about this many logits.
DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 27}


@dataclass(frozen=True)
class LogprobSettings:
    """How chosen-token log-probs are computed: ``chunk_size`` positions per eager chunk
    (None: about 16M logits a chunk on the CPU, 128M on a GPU) and the ``kernel``
    (``"auto"``: compiled on a GPU with Triton, else eager)."""

    chunk_size: int | None = None
    kernel: str = "auto"

    def __post_init__(self) -> None:
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"logprob_chunk_size must be a positive int, got {size!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"logprob_kernel must be one of {KERNELS}, got {self.kernel!r}")


_SETTINGS: contextvars.ContextVar[LogprobSettings] = contextvars.ContextVar(
    "phalanx_logprob_settings",
    default=LogprobSettings(),  # noqa: B039 (frozen)
)


@contextlib.contextmanager
def logprob_settings(
    chunk_size: int | None = None, kernel: str = "auto"
) -> Generator[LogprobSettings, None, None]:
    """Use ``chunk_size`` and ``kernel`` for the log-probs computed inside the block.

    Raises:
        ValueError: ``chunk_size`` is not a positive int or ``kernel`` not one of ``KERNELS``.
    """
    settings = LogprobSettings(chunk_size, kernel)
    token = _SETTINGS.set(settings)
    try:
        yield settings
    finally:
        _SETTINGS.reset(token)


def _chunk_positions(
    batch: int, vocab: int, chunk_size: int | None, device: torch.device | None = None
) -> int:
    if chunk_size is not None:
        LogprobSettings(chunk_size)  # raises for a size that is not a positive int
        return chunk_size
    kind = "cuda" if device is not None and device.type == "cuda" else "cpu"
    return max(1, DEFAULT_CHUNK_ELEMENTS[kind] // max(1, batch * vocab))


def _fused_forward(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    lse = torch.logsumexp(xf, dim=-1)
    return xf.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse, lse


def _row_entropy(x: torch.Tensor) -> torch.Tensor:
    """The entropy of each row of logits ``x`` [n, V], in float32: ``logsumexp - E_p[x]``."""
    xf = x.float()
    lse = torch.logsumexp(xf, dim=-1)
    return lse - (torch.exp(xf - lse.unsqueeze(-1)) * xf).sum(-1)


def _fused_backward(
    x: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    p = torch.exp(x.float() - lse.unsqueeze(-1))
    hit = torch.arange(x.shape[-1], device=x.device) == targets.unsqueeze(-1)
    return ((hit.float() - p) * grad.unsqueeze(-1)).to(x.dtype)


_compiled: dict[str, Callable[..., Any]] = {}
_compile_failed: list[str] = []  # why "auto" fell back to eager in this process
_runs: collections.Counter[str] = collections.Counter()


def kernel_runs() -> dict[str, int]:
    """How many log-prob forwards each kernel computed in this process (``"compiled"``,
    ``"eager"``): benchmarks report which one ran, since ``"auto"`` may fall back."""
    return dict(_runs)


def _compiled_kernels() -> tuple[Callable[..., Any], ...]:
    if not _compiled:
        # Dynamic shapes from the first call: every micro-batch has its own number of
        # positions, and a recompile per shape would soon hit dynamo's limit (after which
        # it runs the unfused function, with its full-size temporaries).
        _compiled["forward"] = torch.compile(_fused_forward, dynamic=True)
        _compiled["backward"] = torch.compile(_fused_backward, dynamic=True)
        _compiled["entropy"] = torch.compile(_row_entropy, dynamic=True)
    return _compiled["forward"], _compiled["backward"], _compiled["entropy"]


def resolve_kernel(kernel: str, device: torch.device, plain: bool = True) -> str:
    """The kernel ``"auto"`` stands for on ``device`` (in this process): ``"compiled"`` for
    plain tensors (not DTensors: ``plain``) on a GPU with Triton unless compiling already
    failed here, else ``"eager"``."""
    if kernel != "auto":
        return kernel
    if not plain or device.type != "cuda" or _compile_failed:
        return "eager"
    return "compiled" if _has_triton() else "eager"


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None  # asked once: it searches sys.path


def _run_compiled(kernel: str, which: int, *args: torch.Tensor) -> Any:
    """The compiled kernel ``which`` (0: forward, 1: backward, 2: entropy) on ``args``; None when it
    fails to compile under ``"auto"`` (a warning says why, and eager is used from then on)."""
    try:
        return _compiled_kernels()[which](*args)
    except torch.OutOfMemoryError:
        raise  # the eager kernel would not fit either
    except Exception as exc:  # a compiler failure: Triton, a C++ toolchain, an unsupported op
        if kernel == "compiled":
            raise RuntimeError(
                f"logprob_kernel='compiled': torch.compile failed ({type(exc).__name__}: "
                f"{exc}); set logprob_kernel to 'eager' or 'auto'"
            ) from exc
        _compile_failed.append(f"{type(exc).__name__}: {exc}")
        warnings.warn(
            f"log-prob kernel: torch.compile failed ({_compile_failed[-1]}); using the eager "
            "kernel in this process",
            stacklevel=3,
        )
        return None


class _ChosenLogprobs(torch.autograd.Function):
    """``logits[target] - logsumexp(logits)`` for logits [B, L, V] and targets [B, T <= L].

    Every one of the B * L positions is computed (a position past T gets target 0 and a
    zero gradient), so that the logits are read as contiguous [B * L, V] rows.
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, settings: LogprobSettings
    ) -> torch.Tensor:
        B, T = targets.shape
        L, V = logits.shape[1], logits.shape[2]
        rows = logits.reshape(B * L, V)
        full = targets.new_zeros((B, L))
        full[:, :T] = targets
        full = full.reshape(-1)
        kernel = resolve_kernel(settings.kernel, logits.device, type(logits) is torch.Tensor)
        step = B * _chunk_positions(B, V, settings.chunk_size, logits.device)
        got = _run_compiled(settings.kernel, 0, rows, full) if kernel == "compiled" else None
        if got is not None:
            out, lse = got
        else:
            kernel = "eager"
            out = torch.empty(B * L, dtype=torch.float32, device=logits.device)
            lse = torch.empty_like(out)
            for s in range(0, B * L, step):
                x, t = rows[s : s + step].float(), full[s : s + step].unsqueeze(-1)
                out[s : s + step] = torch.log_softmax(x, dim=-1).gather(-1, t).squeeze(-1)
                lse[s : s + step] = x.gather(-1, t).squeeze(-1) - out[s : s + step]
        ctx.save_for_backward(logits, full, lse)
        _runs[kernel] += 1
        ctx.kernel, ctx.requested, ctx.step, ctx.T = kernel, settings.kernel, step, T
        return out.view(B, L)[:, :T].contiguous()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, full, lse = ctx.saved_tensors
        B, L, V = logits.shape
        rows = logits.reshape(B * L, V)
        g = torch.zeros((B, L), dtype=torch.float32, device=logits.device)
        g[:, : ctx.T] = grad_out
        g = g.reshape(-1)
        if ctx.kernel == "compiled":
            grad = _run_compiled(ctx.requested, 1, rows, full, lse, g)
            if grad is not None:
                return grad.view(B, L, V), None, None
        grad = torch.empty((B * L, V), dtype=logits.dtype, device=logits.device)
        for s in range(0, B * L, ctx.step):
            e = s + ctx.step
            gs = g[s:e].unsqueeze(-1)
            p = torch.sub(rows[s:e], lse[s:e].unsqueeze(-1)).exp_()  # float32: lse promotes
            p.mul_(-gs).scatter_add_(-1, full[s:e].unsqueeze(-1), gs)
            grad[s:e] = p
        return grad.view(B, L, V), None, None


def chosen_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, chunk_size: int | None = None
) -> torch.Tensor:
    """``log p(targets[b, t])`` under ``logits[b, t]``: [B, T] float32 from logits
    [B, >= T, V] (positions past T are not used) and targets [B, T].

    ``chunk_size`` (positions per eager chunk) overrides ``logprob_settings``'s; the kernel
    is the one ``logprob_settings`` names. Differentiable with respect to ``logits``.
    """
    B, T = targets.shape
    if logits.ndim != 3 or logits.shape[0] != B or logits.shape[1] < T:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree"
        )
    settings = _SETTINGS.get()
    if chunk_size is not None:
        settings = LogprobSettings(chunk_size, settings.kernel)
    if T == 0:
        return logits.new_zeros((B, 0), dtype=torch.float32)
    return _ChosenLogprobs.apply(logits, targets.to(logits.device), settings)


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
    """Sum over ``mask`` of the entropy of ``logits`` [B, T, V] (mask [B, T]), float32.

    Only the positions with a nonzero mask are computed, a chunk of positions at a time
    (``chunk_size``, else ``logprob_settings``'s): at most one chunk's rows are copied, never
    the logits of every counted position at once. The kernel is ``logprob_settings``'s
    (compiled: one fused pass over each row, read in the logits' dtype).
    """
    B, T, V = logits.shape
    settings = _SETTINGS.get()
    chunk = chunk_size if chunk_size is not None else settings.chunk_size
    step = _chunk_positions(B, V, chunk, logits.device)
    kernel = resolve_kernel(settings.kernel, logits.device, type(logits) is torch.Tensor)
    mask = mask.to(logits.device)
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for s in range(0, T, step):
        weights = mask[:, s : s + step]
        keep = weights != 0
        rows = logits[:, s : s + step][keep]  # [n, V]: this chunk's counted positions
        if rows.shape[0] == 0:
            continue
        ent = _run_compiled(settings.kernel, 2, rows) if kernel == "compiled" else None
        if ent is None:
            ent = _row_entropy(rows)
        total += (ent * weights[keep].float()).sum()
    return total
