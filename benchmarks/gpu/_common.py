"""What the GPU benchmarks share: timing on CUDA and the RATIO/RESULT lines they print."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` (synchronised with the GPU) over ``repeats`` runs."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def report(name: str, ratio_name: str, ratio: float, **figures: Any) -> dict[str, Any]:
    """Print ``RATIO <ratio_name> = x`` and a ``RESULT {json}`` line; returns the record."""
    record = {"bench": name, "ratio_name": ratio_name, "ratio": round(ratio, 4), **figures}
    record["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    shown = ", ".join(f"{k} {v}" for k, v in figures.items())
    print(f"RATIO {ratio_name} = {ratio:.3f} ({shown})", flush=True)
    print("RESULT " + json.dumps(record), flush=True)
    return record


def rank0_env() -> None:
    """The environment of rank 0 of a one-process torch.distributed group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def one_rank_policy(path: str, tokenizer: Any, init_optimizer: bool = True) -> Any:
    """A bf16 ``DTensorPolicyWorker`` of the model at ``path`` as rank 0 of a one-process
    group in this process (batch sizes of 1: the benchmarks call it directly)."""
    import phalanx as px

    rank0_env()
    cfg = {
        "model_name": path,
        "precision": "bfloat16",
        "train_global_batch_size": 1,
        "train_micro_batch_size": 1,
    }
    return px.DTensorPolicyWorker(
        cfg, tokenizer, init_optimizer=init_optimizer, init_reference_model=False
    )


CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
ARCHS = sorted(f[: -len(".json")] for f in os.listdir(CONFIGS) if f.endswith(".json"))

# Dense bf16 tensor-core peaks (FLOP/s) by the name torch reports, for model FLOPs utilisation.
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def model_path(flag: str | None, workdir: str) -> str:
    """The model a benchmark runs: ``flag`` or ``$PHALANX_GPU_MODEL``, either a folder with a
    ``config.json`` or an architecture of ``configs/`` (e.g. ``qwen2.5-0.5b``, built with
    random weights under ``$PHALANX_GPU_MODELS``, default ``<tmp>/px_models``); else the
    tiny test model built under ``workdir``."""
    path = flag or os.environ.get("PHALANX_GPU_MODEL")
    if path in ARCHS:  # built once per machine, then reused by every benchmark
        cache = os.environ.get(
            "PHALANX_GPU_MODELS", os.path.join(tempfile.gettempdir(), "px_models")
        )
        built = os.path.join(cache, path)
        if os.path.exists(os.path.join(built, "model.safetensors.index.json")) or os.path.exists(
            os.path.join(built, "model.safetensors")
        ):
            return built
        return build_arch_model(path, built)
    if path:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise SystemExit(
                f"--model / PHALANX_GPU_MODEL: {path!r} is neither a folder with a config.json "
                f"nor one of {ARCHS}"
            )
        return path
    from phalanx.algorithms.grpo_tiny_task import build_tiny_model

    return build_tiny_model(os.path.join(workdir, "tiny_model"))


def build_arch_model(arch: str, path: str, **overrides: Any) -> str:
    """A model of the published architecture ``configs/<arch>.json`` with random weights,
    saved (bf16) with the tiny task's character tokenizer to ``path``; returns ``path``.

    Speed does not depend on the weights' values, so nothing is downloaded. The weights
    are initialised on the GPU when there is one (seconds, where a 1.5B model takes a
    minute on the CPU). ``overrides`` change config fields (the CPU tests shrink the model).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.algorithms.grpo_tiny_task import build_tokenizer

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    with open(os.path.join(CONFIGS, f"{arch}.json")) as f:
        fields = json.load(f)
    tokenizer = build_tokenizer()
    fields.update(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **overrides,
    )
    config = AutoConfig.for_model(**fields)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


# The widths of a "narrow" architecture (``narrow_model``); everything else is the published one's.
NARROW = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}


def narrow_model(arch: str, workdir: str) -> str:
    """``arch`` with every tensor of the published architecture (its layers, names and tied
    weights) at the widths of ``NARROW``, built under ``workdir``: its weights take about
    2 MiB, so timing it measures what an operation over the real model's tensors costs
    besides moving their bytes."""
    if arch not in ARCHS:
        raise SystemExit(f"--narrow needs --model naming one of {ARCHS}, got {arch!r}")
    return build_arch_model(arch, os.path.join(workdir, f"{arch}-narrow"), **NARROW)


def bf16_peak_flops() -> float | None:
    """The dense bf16 peak of GPU 0 (FLOP/s), or None for a card not in ``BF16_PEAK``."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for key, peak in BF16_PEAK.items() if key in name), None)


KERNEL_KINDS = (  # (kind, substrings of a CUDA kernel's name), first match wins
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "sm90_")),
    ("nccl", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax", ("softmax", "logsoftmax")),
    ("copy/cast", ("copy", "memcpy", "memset", "cat", "fill")),
    ("reduce", ("reduce",)),
)


def kernel_kind(name: str) -> str:
    """The kind of a CUDA kernel by its name (``KERNEL_KINDS``; else ``elementwise/other``)."""
    low = name.lower()
    return next(
        (kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "elementwise/other"
    )


def profile_summary(fn: Callable[[], Any], label: str, rows: int = 12) -> str:
    """One profiled call of ``fn``: the GPU's busy share of the wall time, its kernel time
    by kind and the kernels (or CPU ops, without CUDA) that took the most; also printed."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    if cuda:
        kernels = [e for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA"]
        busy = sum(e.device_time_total for e in kernels) / 1e6
        lines = [f"PROFILE {label}: wall {wall:.3f} s, GPU busy {busy:.3f} s ({busy / wall:.0%})"]
        by_kind: dict[str, float] = {}
        for e in kernels:
            kind = kernel_kind(e.key)
            by_kind[kind] = by_kind.get(kind, 0.0) + e.device_time_total / 1e3
        lines.append(
            "  by kind (ms): "
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
        )
        top = sorted(kernels, key=lambda e: e.device_time_total, reverse=True)[:rows]
        lines += [
            f"  {e.device_time_total / 1e3:9.1f} ms  {e.count:6d}x  {e.key[:90]}" for e in top
        ]
    else:
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:rows]
        lines = [f"PROFILE {label}: wall {wall:.3f} s (CPU ops, self time)"]
        lines += [
            f"  {e.self_cpu_time_total / 1e3:9.1f} ms  {e.count:6d}x  {e.key[:90]}" for e in top
        ]
    text = "\n".join(lines)
    print(text, flush=True)
    return text
