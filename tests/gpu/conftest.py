"""Fixtures of the GPU kit. ``benchmarks/gpu/run_kit.sh`` runs these tests with
``--confcutdir tests/gpu`` so that ``tests/conftest.py`` (which imports Ray to share one
cluster) is not loaded: this file needs neither Ray nor a GPU to be collected."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Ray workers and spawned processes import test helpers (``tests.gpu...``) by name.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "ray_cluster: starts a local Ray with the GPU declared")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The tiny Llama of the LLM tests, saved once per session."""
    from phalanx.algorithms.grpo_tiny_task import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def rank0_env(monkeypatch) -> dict[str, str]:
    """The environment of rank 0 of a one-process torch.distributed group."""
    from tests.gpu.procs import rank0_env_vars

    env = rank0_env_vars()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env
