"""fp32 vs bf16 training speed of the GRPO policy's model on this machine.

Times one forward+backward of a GRPO-like batch (default 8 x 104 tokens) in three
precisions: fp32, bf16 autocast over fp32 weights (what ``precision="bfloat16"`` does),
and pure bf16 weights. For each it prints the time and the achieved FLOP rate
(6 x parameters x tokens / time) as a fraction of a plain fp32 matrix product measured in
the same run with the same thread count (``torch.mm`` of ``--mm-size`` squared, large
enough to keep every core busy), then RATIO lines (bf16 time / fp32 time; above 1 means
bf16 is slower) and what ``precision="auto"`` picks here.

On a CPU without AVX-512 BF16 or AMX, bf16 steps of the real model take minutes each.

    phalanx models fetch smollm2-135m-instruct
    python benchmarks/bench_precision.py                  # the real model if fetched
    python benchmarks/bench_precision.py --model tiny     # the tiny config model, in seconds
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from phalanx.algorithms.precision import cpu_flags, has_fast_bf16, resolve_precision

REAL = "smollm2-135m-instruct"
VARIANTS = ("fp32", "bf16-autocast", "bf16-weights")


def load_model(choice: str, seq_len: int) -> tuple[torch.nn.Module, str]:
    """The model to time and a sentence saying which it is. ``auto``: the real model if
    fetched, else the tiny one."""
    from transformers import AutoModelForCausalLM

    from phalanx.llm.models import cache_root, is_hf_folder

    real = os.path.join(cache_root(), REAL)
    with tempfile.TemporaryDirectory(prefix="bench_precision_") as tmp:
        if choice == REAL or (choice == "auto" and is_hf_folder(real)):
            if not is_hf_folder(real):
                raise SystemExit(
                    f"bench_precision: {REAL} is not fetched; run `phalanx models fetch {REAL}` "
                    "or pass --model tiny"
                )
            path, which = real, f"the real {REAL} ({real})"
        else:
            from phalanx.algorithms.grpo_tiny_task import TinyModelConfig, build_tiny_model

            path = build_tiny_model(tmp, TinyModelConfig(max_position_embeddings=max(64, seq_len)))
            which = "the tiny config model (random init)"
            if choice == "auto":
                which += f": {REAL} is not fetched (`phalanx models fetch {REAL}`)"
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        )
    model.config.use_cache = False
    return model.train(), which


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mm_rate(n: int, dtype: torch.dtype, repeats: int, warmup: int = 1) -> float:
    """FLOP/s of an ``n`` x ``n`` ``torch.mm`` in ``dtype``."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_seconds(lambda: torch.mm(a, b), repeats, warmup)


def train_step(model: torch.nn.Module, ids: torch.Tensor, autocast: bool) -> Callable[[], None]:
    """One forward+backward of a causal-LM loss on ``ids``, gradients cleared after."""

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("auto", REAL, "tiny"), default="auto")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--seq-len", type=int, default=104, help="tokens per sequence (default 104)")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--mm-size", type=int, default=2048, help="side of the baseline matmul")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = ap.parse_args()
    for name in ("batch", "seq_len", "repeats", "threads", "mm_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    model, which = load_model(args.model, args.seq_len)
    params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.seq_len
    flops = 6 * params * tokens
    print(f"model: {which}, {params / 1e6:.2f}M parameters")
    print(f"batch: {args.batch} x {args.seq_len} tokens, {threads} torch threads, CPU")

    fp32_rate = mm_rate(args.mm_size, torch.float32, args.repeats)
    bf16_rate = mm_rate(args.mm_size, torch.bfloat16, 1, warmup=0)  # seconds per call on AVX2
    print(
        f"torch.mm {args.mm_size}x{args.mm_size}: fp32 {fp32_rate / 1e9:.1f} GFLOP/s, "
        f"bf16 {bf16_rate / 1e9:.1f} GFLOP/s"
    )
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
    seconds: dict[str, float] = {}
    for variant in args.variants:
        m = copy.deepcopy(model).to(torch.bfloat16) if variant == "bf16-weights" else model
        step = train_step(m, ids, autocast=variant == "bf16-autocast")
        seconds[variant] = s = median_seconds(step, args.repeats, args.warmup)
        rate = flops / s
        print(
            f"{variant:>14}: {s:.3f} s per forward+backward, {rate / 1e9:.2f} GFLOP/s, "
            f"{rate / fp32_rate:.1%} of the fp32 matmul rate",
            flush=True,
        )
    for variant in ("bf16-autocast", "bf16-weights"):
        if variant in seconds and "fp32" in seconds:
            print(f"RATIO {variant} / fp32 time: {seconds[variant] / seconds['fp32']:.2f}x")
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    cuda = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    print(
        f'precision="auto" picks {resolve_precision("auto")} here '
        f"(fast bf16: {has_fast_bf16()}; CUDA bf16: {cuda}; CPU flags: {', '.join(flags) or 'none'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
