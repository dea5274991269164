"""``phalanx status``: live groups, their workers, health, restarts and current call."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

import phalanx as px
from phalanx.cli import status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Busy(px.Worker):
    def sleep(self, s: float):
        time.sleep(s)
        return self.rank

    def pid(self):
        return os.getpid()

    def block_until(self, path: str, timeout_s: float = 60.0):
        """Busy until ``path`` exists (the test decides when the call ends)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.rank


def _group(groups, name):
    found = [g for g in groups if g.name == name]
    assert len(found) == 1, [g.name for g in groups]
    return found[0]


@pytest.mark.timeout(150)
def test_status_shows_workers_health_current_call_and_restarts(cluster, tmp_path):
    g = Busy.create_group().launch(
        cluster,
        placement=px.NodePlacement(num_workers=3),
        name="status_busy",
        restart_policy=px.RestartPolicy(),
    )
    try:
        release = str(tmp_path / "release")
        handle = g.execute_on(1).block_until(release)
        time.sleep(1.0)
        st = _group(status.collect_status(timeout_s=10, group="status_busy"), "status_busy")
        assert st.world_size == 3 and [w.rank for w in st.workers] == [0, 1, 2]
        assert [w.health for w in st.workers] == ["healthy"] * 3
        assert [w.current_call for w in st.workers] == [None, "block_until", None]
        assert st.workers[1].call_seconds >= 0.5
        pids = [md["pid"] for md in g.worker_metadata]
        assert [w.pid for w in st.workers] == pids
        assert all(w.node_ip for w in st.workers) and st.restarts == 0
        assert st.workers[0].worker_class.endswith("Busy")

        # The CLI in another process, joining this cluster by address, sees the same.
        address = ray.get_runtime_context().gcs_address
        env = dict(os.environ, PYTHONPATH=ROOT)
        out = subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "status", "--address", address, "--json"],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        listed = {x["name"]: x for x in json.loads(out.stdout)}
        workers = listed["status_busy"]["workers"]
        assert [w["health"] for w in workers] == ["healthy"] * 3
        assert workers[1]["current_call"] == "block_until", out.stdout
        open(release, "w").close()
        assert handle.wait(timeout=60) == [1]  # the job was not disturbed

        # A restart shows up in the worker's count.
        os.kill(pids[2], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while g.num_remote_worker_restarts() < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert g.wait_healthy(60)
        st = _group(status.collect_status(timeout_s=10, group="status_busy"), "status_busy")
        assert [w.restarts for w in st.workers] == [0, 0, 1]
        assert [w.health for w in st.workers] == ["healthy"] * 3
    finally:
        g.shutdown()
    assert status.collect_status(timeout_s=5, group="status_busy") == []


@pytest.mark.timeout(60)
def test_status_table_and_bad_input(cluster, capsys):
    from rich.console import Console

    g = Busy.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="status_table"
    )
    try:
        groups = status.collect_status(timeout_s=10, group="status_table")
        console = Console(record=True, width=160)
        status.render(groups, console=console)
        text = console.export_text()
        assert "status_table" in text and "2/2 healthy" in text and text.count("healthy") >= 3
    finally:
        g.shutdown()
    with pytest.raises(ValueError, match="timeout_s"):
        status.collect_status(timeout_s=0)


@pytest.mark.timeout(90)
def test_status_cli_without_a_cluster_fails_fast():
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", "--address", "127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=80,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert out.returncode == 1
    assert "no Ray cluster at '127.0.0.1:1'" in out.stdout
