"""Ray's start-up, retried on a busy machine: real start failures are provoked with
``RAY_gcs_server_port_wait_time_s=0`` (Ray then gives its GCS no time to publish its port,
the failure a loaded machine shows), in fresh processes so the session's Ray is untouched."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import ray

import phalanx as px
from phalanx.resources.ray_start import (
    START_TIMEOUT_ENV,
    RayStartError,
    is_start_failure,
    retry_start,
    start_ray,
    start_timeout_s,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "RAY_gcs_server_port_wait_time_s": "0", **env}
    full_env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-c", script],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_cluster_start_failure_ends_in_one_line_error_naming_the_setting():
    script = (
        "import phalanx as px\n"
        "from phalanx.resources.ray_start import RayStartError\n"
        "try:\n"
        "    px.Cluster(num_cpus=1)\n"
        "except RayStartError as e:\n"
        "    print('ERROR', e)\n"
    )
    proc = _run(script, **{START_TIMEOUT_ENV: "2.5"})
    assert proc.returncode == 0, proc.stderr
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR ")]
    assert len(errors) == 1, proc.stdout
    message = errors[0]
    assert f"({START_TIMEOUT_ENV}=2.5)" in message
    assert "last cause: Timed out waiting for file" in message
    tries = int(re.search(r"did not start in (\d+) tries", message).group(1))
    assert tries >= 2
    retries = [line for line in proc.stderr.splitlines() if "retrying in" in line]
    assert len(retries) == tries - 1, proc.stderr
    assert retries[0].startswith("phalanx: Ray start try 1 failed: Timed out waiting for file")
    assert f"left of {START_TIMEOUT_ENV}=2.5)" in retries[0]


def test_retry_recovers_after_a_real_start_failure():
    script = (
        "import os, ray\n"
        "from phalanx.resources.ray_start import retry_start\n"
        "calls = []\n"
        "def start():\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        "        del os.environ['RAY_gcs_server_port_wait_time_s']\n"
        "    return ray.init(address='local', num_cpus=1, include_dashboard=False)\n"
        "retry_start(start, timeout_s=120)\n"
        "print('CALLS', len(calls), ray.is_initialized())\n"
        "ray.shutdown()\n"
    )
    proc = _run(script)
    assert proc.returncode == 0, proc.stderr
    assert "CALLS 2 True" in proc.stdout.splitlines(), proc.stdout
    retries = [line for line in proc.stderr.splitlines() if "retrying in 1.0 s" in line]
    assert len(retries) == 1, proc.stderr


@pytest.mark.smoke
def test_other_errors_are_not_retried():
    calls = []

    def start():
        calls.append(1)
        raise ValueError("num_cpus must be an int")

    with pytest.raises(ValueError, match="num_cpus must be an int"):
        retry_start(start, timeout_s=60)
    assert calls == [1]


def test_spent_budget_raises_ray_start_error_after_one_try():
    calls = []

    def start():
        calls.append(1)
        raise RuntimeError("The current node timed out during startup. This could happen")

    with pytest.raises(RayStartError) as info:
        retry_start(start, timeout_s=0)
    assert calls == [1]
    assert str(info.value) == (
        f"Ray did not start in 1 tries within 0 s ({START_TIMEOUT_ENV}=0); last cause: The "
        f"current node timed out during startup. This could happen (a busy machine: raise "
        f"{START_TIMEOUT_ENV})"
    )
    assert isinstance(info.value, RuntimeError)


@pytest.mark.smoke
def test_which_failures_are_start_failures():
    assert is_start_failure(Exception("The current node timed out during startup. This"))
    assert is_start_failure(RuntimeError("Failed to start GCS.  Last 3 lines of error files"))
    assert is_start_failure(RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs"))
    assert not is_start_failure(ValueError("Unknown keyword argument(s): bogus"))
    assert not is_start_failure(ConnectionError("Could not find any running Ray instance."))


def test_start_timeout_setting(monkeypatch):
    monkeypatch.delenv(START_TIMEOUT_ENV, raising=False)
    assert start_timeout_s() == 300.0
    monkeypatch.setenv(START_TIMEOUT_ENV, "12.5")
    assert start_timeout_s() == 12.5
    monkeypatch.setenv(START_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{START_TIMEOUT_ENV} must be a number of seconds"):
        start_timeout_s()
    monkeypatch.setenv(START_TIMEOUT_ENV, "-1")
    with pytest.raises(ValueError, match=f"{START_TIMEOUT_ENV} must be >= 0, got '-1'"):
        start_timeout_s()


def test_start_ray_checks_its_argument_and_keeps_a_running_ray(cluster):
    with pytest.raises(TypeError, match="logical_cpus must be an int"):
        start_ray(True)
    with pytest.raises(ValueError, match="logical_cpus must be >= 1, got 0"):
        start_ray(0)
    before = ray.cluster_resources()["CPU"]
    start_ray(3)
    assert ray.cluster_resources()["CPU"] == before


def test_cluster_checks_its_arguments():
    with pytest.raises(ValueError, match="num_nodes must be >= 1, got 0"):
        px.Cluster(num_nodes=0)
    with pytest.raises(TypeError, match="num_nodes must be an int"):
        px.Cluster(num_nodes=True)
    with pytest.raises(TypeError, match="timeout_s must be a number"):
        px.Cluster(timeout_s="1")


def test_embedded_ray_runs_workers_at_nice_0_and_returns_sample_sized_results_inline():
    # A 4-env x 256-step HalfCheetah batch is ~111 KiB, over Ray's 100 KiB default for
    # returning a result in the reply; through the object store it costs the raylet and
    # the caller a few ms a call, which two runners on 2 cores feel.
    # The owner learns an object's location asynchronously, so the script polls (with a
    # deadline) until the 2 MB result is located; the 200 kB one, made first, would have
    # been reported by then had it gone to the store.
    script = (
        "import os, ray, numpy as np\n"
        "from phalanx.resources.ray_start import start_ray\n"
        "from tests.helpers import until\n"
        "start_ray()\n"
        "@ray.remote\n"
        "def make(n):\n"
        "    return os.nice(0), np.zeros(n, np.uint8)\n"
        "refs = {}\n"
        "for n in (200_000, 2_000_000):\n"
        "    refs[n] = make.remote(n)\n"
        "    nice, arr = ray.get(refs[n])\n"
        "    print('GOT', n, nice, arr.nbytes)\n"
        "def nodes(ref):\n"
        "    return len(ray.experimental.get_object_locations([ref])[ref]['node_ids'])\n"
        "until(lambda: nodes(refs[2_000_000]) > 0, 60)\n"
        "print('WHERE', nodes(refs[200_000]), nodes(refs[2_000_000]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines()]
    got = [line[1:] for line in lines if line[:1] == ["GOT"]]
    where = [line[1:] for line in lines if line[:1] == ["WHERE"]]
    assert got == [["200000", "0", "200000"], ["2000000", "0", "2000000"]]  # nice 0
    # inline: in no node's object store; 2 MB: in this node's
    assert where == [["0", "1"]]
