"""What the GPU benchmarks share: timing on CUDA and the RATIO/RESULT lines they print."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` (synchronised with the GPU) over ``repeats`` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def report(name: str, ratio_name: str, ratio: float, **figures: Any) -> dict[str, Any]:
    """Print ``RATIO <ratio_name> = x`` and a ``RESULT {json}`` line; returns the record."""
    record = {"bench": name, "ratio_name": ratio_name, "ratio": round(ratio, 4), **figures}
    record["device"] = torch.cuda.get_device_name(0)
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


def model_path(flag: str | None, workdir: str) -> str:
    """``flag`` or ``$PHALANX_GPU_MODEL`` (e.g. a SmolLM2-135M folder), else the tiny test
    model built from its config under ``workdir``."""
    path = flag or os.environ.get("PHALANX_GPU_MODEL")
    if path:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise SystemExit(f"--model / PHALANX_GPU_MODEL: {path!r} has no config.json")
        return path
    from phalanx.algorithms.grpo_tiny_task import build_tiny_model

    return build_tiny_model(os.path.join(workdir, "tiny_model"))
