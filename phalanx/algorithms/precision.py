"""``precision="auto"``: bf16 only where the hardware multiplies bf16 matrices fast.

A CUDA GPU with bf16 support, or a CPU with AVX-512 BF16 or AMX units, runs bf16 matrix
products at least as fast as fp32. A CPU without them (AVX2 only) emulates bf16 and is
many times slower than fp32 (``benchmarks/bench_precision.py``), so "auto" gives fp32
there.
"""

from __future__ import annotations

PRECISIONS = ("auto", "float32", "bfloat16")
_FAST_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (empty where it cannot be read)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def has_fast_bf16(*, cuda: bool | None = None, flags: set[str] | None = None) -> bool:
    """Whether bf16 is fast here: CUDA with bf16 (``cuda``: whether such a GPU is used;
    None: ask torch), else a CPU whose ``flags`` (None: /proc/cpuinfo) name AVX-512 BF16
    or AMX."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if cuda:
        return True
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in _FAST_BF16_CPU_FLAGS)


def resolve_precision(
    value: str, arg: str = "precision", *, cuda: bool | None = None, flags: set[str] | None = None
) -> str:
    """``value`` itself when forced (float32, bfloat16); for "auto" bfloat16 where
    :func:`has_fast_bf16`, else float32. ``ValueError`` naming ``arg`` otherwise."""
    if value not in PRECISIONS:
        raise ValueError(f"{arg} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    if value != "auto":
        return value
    return "bfloat16" if has_fast_bf16(cuda=cuda, flags=flags) else "float32"
