"""One local Ray instance shared by the whole test session.

Tests that need a different Ray (several nodes, declared GPUs) use ``fresh_ray`` which
shuts the shared one down; the next test that asks for ``cluster`` starts it again.
"""

from __future__ import annotations

import os
import sys

import pytest
import ray

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Workers import test helpers (``tests.workers``) by name: make the repo root importable.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import phalanx as px  # noqa: E402
from phalanx.resources.ray_start import RayStartError  # noqa: E402

SESSION_CPUS = 32
_state: dict[str, px.Cluster] = {}


def _start_shared() -> px.Cluster:
    """The shared Ray, on loopback (every phalanx listener of the suite binds to 127.0.0.1).

    ``px.Cluster`` retries Ray's start on a busy machine; when even that fails, the
    session stops with one line instead of an error per test."""
    try:
        return px.Cluster(num_cpus=SESSION_CPUS, num_gpus=0, _node_ip_address="127.0.0.1")
    except RayStartError as e:
        pytest.exit(f"Ray could not start: {e}", returncode=4)


@pytest.fixture(scope="session")
def cluster() -> px.Cluster:
    """The shared local Ray of the session (restarted in place after a ``fresh_ray`` test)."""
    if "cluster" not in _state:
        if ray.is_initialized():
            _state["cluster"] = px.Cluster()
        else:
            _state["cluster"] = _start_shared()
    return _state["cluster"]


@pytest.fixture
def fresh_ray():
    """Shut the shared Ray down for a test that starts its own (several nodes, GPUs).

    Afterwards the shared Ray is started again and the session's ``cluster`` object is
    pointed at it, so later tests keep working.
    """
    if ray.is_initialized():
        ray.shutdown()
    yield
    if ray.is_initialized():
        ray.shutdown()
    if "cluster" in _state:
        _state["cluster"].__dict__.update(_start_shared().__dict__)


@pytest.fixture(scope="session")
def model_path(tmp_path_factory):
    """The tiny decoder of the LLM tests, saved once per session (tests only read it)."""
    from phalanx.algorithms.grpo_tiny_task import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def pytest_sessionfinish(session, exitstatus):
    if ray.is_initialized():
        ray.shutdown()
