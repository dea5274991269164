"""Chosen-token log-probs, forward and backward: phalanx's kernels against ``log_softmax``.

The baseline is what a plain training loop writes: ``log_softmax(logits[:, :-1].float())``
then ``gather`` of the next tokens, differentiated by autograd. phalanx's ``eager`` kernel
(stock ops over chunks of rows) and ``compiled`` kernel (one ``torch.compile``d reduction and
one pointwise backward) compute the same values from logits in the model's dtype. Each
variant's median seconds (and, on a GPU, its peak memory above the logits) over
``--repeats``; prints ``RATIO logprobs_<kernel>/log_softmax`` per kernel and one ``RESULT``.

Defaults: a GRPO micro-batch of Qwen2.5 on a GPU (8 rows x 1024 positions, 151,936 tokens,
bf16); a smaller float32 one on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import report, timed  # noqa: E402


def plain_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The baseline: full-vocabulary float32 log-softmax, then the next tokens' values."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def main(argv: list[str] | None = None) -> dict:
    from phalanx.llm.logprobs import kernel_runs, logprob_settings, token_logprobs

    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8 if cuda else 4)
    ap.add_argument("--seq", type=int, default=1024 if cuda else 256)
    ap.add_argument("--vocab", type=int, default=151_936 if cuda else 49_152)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if min(args.rows, args.seq, args.vocab, args.repeats) < 1:
        ap.error("--rows, --seq, --vocab and --repeats must be >= 1")
    device = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    g = torch.Generator(device=device).manual_seed(0)
    shape = (args.rows, args.seq + 1, args.vocab)
    logits = (torch.randn(shape, generator=g, device=device) * 3).to(dtype).requires_grad_()
    ids = torch.randint(0, args.vocab, (args.rows, args.seq + 1), generator=g, device=device)
    weights = torch.randn(args.rows, args.seq, generator=g, device=device)

    def step(kernel: str) -> torch.Tensor:
        logits.grad = None
        if kernel == "log_softmax":
            lp = plain_logprobs(logits, ids)
        else:
            with logprob_settings(kernel=kernel):
                lp = token_logprobs(logits, ids)
        (lp * weights).sum().backward()
        return lp.detach()

    seconds, peak_mb, values = {}, {}, {}
    for kernel in ("log_softmax", "eager", "compiled"):
        before = kernel_runs()
        values[kernel] = step(kernel)  # also compiles, for "compiled"
        if kernel != "log_softmax" and kernel_runs().get(kernel, 0) == before.get(kernel, 0):
            raise SystemExit(f"the {kernel!r} kernel did not run")  # e.g. fell back
        if cuda:
            logits.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(kernel)
            torch.cuda.synchronize()
            peak_mb[kernel] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
        seconds[kernel] = timed(lambda k=kernel: step(k), args.repeats, warmup=0)
    errors = {k: float((values[k] - values["log_softmax"]).abs().max()) for k in values}
    for kernel in ("eager", "compiled"):
        print(
            f"RATIO logprobs_{kernel}/log_softmax = {seconds['log_softmax'] / seconds[kernel]:.3f}"
            f" ({seconds[kernel] * 1e3:.1f} ms against {seconds['log_softmax'] * 1e3:.1f} ms)",
            flush=True,
        )
    return report(
        "bench_logprobs",
        "logprobs_compiled/log_softmax",
        seconds["log_softmax"] / seconds["compiled"],
        eager_ratio=round(seconds["log_softmax"] / seconds["eager"], 4),
        shape=list(shape),
        dtype=str(dtype).replace("torch.", ""),
        ms={k: round(v * 1e3, 2) for k, v in seconds.items()},
        peak_mb_above_logits=peak_mb or None,
        max_abs_error=errors,
    )


if __name__ == "__main__":
    main()
    raise SystemExit(0)
