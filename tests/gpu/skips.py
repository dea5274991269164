"""Why a GPU-kit test cannot run here, if it cannot: no CUDA, too few GPUs, or no Ray.

Every test under ``tests/gpu`` (except ``test_kit_cpu.py``) carries ``needs_gpu(...)``:
the ``gpu`` marker plus a skip whose message names what is missing. phalanx imports Ray
when it is imported, so every GPU test needs ``ray`` importable; on the lent GPU machine
``benchmarks/gpu/install.sh`` provides it. ``KIT_TESTS`` is how many such tests there are.
"""

from __future__ import annotations

import importlib.util

import pytest

KIT_TESTS = 24  # parametrized cases counted
NO_CUDA = "needs CUDA: torch.cuda.is_available() is False on this machine"
NO_RAY = (
    "needs ray importable (phalanx imports it at import time): run benchmarks/gpu/install.sh "
    "and export the PYTHONPATH it prints"
)


def gpu_count() -> int:
    """CUDA devices torch sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def skip_reason(
    gpus: int = 1, have_gpus: int | None = None, have_ray: bool | None = None
) -> str | None:
    """The reason a test needing ``gpus`` GPUs (and Ray) must skip, or None when it can run."""
    have_gpus = gpu_count() if have_gpus is None else have_gpus
    have_ray = importlib.util.find_spec("ray") is not None if have_ray is None else have_ray
    if have_gpus == 0:
        return NO_CUDA
    if have_gpus < gpus:
        return f"needs {gpus} GPUs (one GPU cannot hold two NCCL ranks), torch sees {have_gpus}"
    if not have_ray:
        return NO_RAY
    return None


def skip_unless(gpus: int = 1) -> pytest.MarkDecorator:
    """Skip the test, naming why, unless ``gpus`` GPUs and Ray are there."""
    reason = skip_reason(gpus)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def needs_gpu(gpus: int = 1) -> list[pytest.MarkDecorator]:
    """``pytestmark`` of a GPU test module: the ``gpu`` marker and ``skip_unless(gpus)``."""
    return [pytest.mark.gpu, skip_unless(gpus)]
