"""One local Ray instance shared by the whole test session.

Tests that need a different Ray (several nodes, declared GPUs) use ``fresh_ray`` which
shuts the shared one down; the next test that asks for ``cluster`` starts it again.

``--max-test-seconds S`` (CI passes 60) fails the session when a test takes longer than S
(set-up, call and tear-down together) without ``@pytest.mark.slow(reason=...)``; a ``slow``
marker without a reason fails the test at set-up. Both hold when the suite runs in
pytest-xdist workers (the README's command), each of which starts its own shared Ray.
docs/testing.md lists what each test costs.
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
def vllm_model_path(tmp_path_factory):
    """The tiny decoder widened to what vLLM's CPU attention takes (head_dim 64), same
    tokenizer; saved once per session."""
    from phalanx.algorithms.grpo_tiny_task import TinyModelConfig, build_tiny_model

    size = TinyModelConfig(
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1
    )
    return build_tiny_model(tmp_path_factory.mktemp("tiny_vllm") / "model", size)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


# seconds per test id; the ids marked slow; those over --max-test-seconds
_took: dict = {"seconds": {}, "slow": set(), "over": []}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--max-test-seconds",
        type=float,
        default=None,
        help="fail the session when a test not marked slow(reason=...) takes longer than this "
        "(set-up, call and tear-down together)",
    )


def _slow_reason(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("slow")
    if marker is None:
        return None
    return marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")


def pytest_runtest_setup(item: pytest.Item) -> None:
    # At set-up, not collection: a pytest-xdist worker's collection error loses its message.
    if _slow_reason(item) == "":
        pytest.fail("slow marker without a reason (write @pytest.mark.slow(reason=...))")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    seconds = _took["seconds"]
    seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
    if "slow" in report.keywords:  # the report, not the item: pytest-xdist's controller
        _took["slow"].add(report.nodeid)  # sees reports only


def pytest_sessionfinish(session, exitstatus):
    if ray.is_initialized():
        ray.shutdown()
    limit = session.config.getoption("--max-test-seconds")
    if limit is None:
        return
    _took["over"] = sorted(
        (
            (s, nodeid)
            for nodeid, s in _took["seconds"].items()
            if s > limit and nodeid not in _took["slow"]
        ),
        reverse=True,
    )
    if _took["over"] and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _took["over"]:
        limit = config.getoption("--max-test-seconds")
        terminalreporter.section(f"tests over {limit:g} s not marked slow(reason=...)", red=True)
        for seconds, nodeid in _took["over"]:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
