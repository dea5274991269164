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

SESSION_CPUS = 32


@pytest.fixture
def cluster() -> px.Cluster:
    """The shared local Ray (started on first use, restarted after a ``fresh_ray`` test)."""
    if not ray.is_initialized():
        _state["cluster"] = px.Cluster(num_cpus=SESSION_CPUS, num_gpus=0)
    c = _state.get("cluster")
    if c is None:
        c = _state["cluster"] = px.Cluster()
    return c


@pytest.fixture
def fresh_ray():
    """Shut the shared Ray down for a test that starts its own (multi-node, GPUs)."""
    if ray.is_initialized():
        ray.shutdown()
    _state.pop("cluster", None)
    yield
    if ray.is_initialized():
        ray.shutdown()


_state: dict[str, px.Cluster] = {}


def pytest_sessionfinish(session, exitstatus):
    if ray.is_initialized():
        ray.shutdown()
