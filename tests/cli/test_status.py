"""``phalanx status``: live groups, their workers, health, restarts and current call."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

import phalanx as px
from phalanx.cli import status
from tests.helpers import until

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

        def busy_half_a_second() -> bool:
            found = status.collect_status(timeout_s=10, group="status_busy")
            shown[:] = [_group(found, "status_busy")]
            worker = shown[0].workers[1]
            return worker.current_call == "block_until" and (worker.call_seconds or 0) >= 0.5

        shown: list[status.GroupStatus] = []
        assert until(busy_half_a_second, 60, interval=0.1), shown
        st = shown[0]
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
@pytest.mark.smoke
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


def test_status_table_wraps_long_names_instead_of_cutting_them():
    from rich.console import Console

    long_class = "tests.workers.EnvRunnerWithAVeryLongClassNameIndeed"
    groups = [
        status.GroupStatus(
            name="g",
            world_size=1,
            workers=[
                status.WorkerStatus(
                    rank=0, health="healthy", node_ip="10.0.0.1", pid=7, worker_class=long_class
                )
            ],
        )
    ]
    console = Console(record=True, width=60)
    status.render(groups, console=console)
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 60
    folded = "".join(line.split("│")[-2].strip() for line in text.splitlines() if "│" in line)
    assert "EnvRunnerWithAVeryLongClassNameIndeed" in folded


@pytest.mark.timeout(90)
def test_status_says_which_cluster_it_shows(cluster):
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=80,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert out.returncode == 0, out.stderr
    session = ray.get_runtime_context().get_session_name()
    line = [x for x in out.stderr.splitlines() if x.startswith("phalanx status: cluster at ")]
    assert line == [f"phalanx status: cluster at {address} ({session})"], out.stderr
    assert isinstance(json.loads(out.stdout), list)


# A token-authenticated head, started with phalanx's retrying start-up (a busy machine),
# that lives until its stdin closes.
_TOKEN_HEAD = """
import sys
from phalanx.resources.ray_start import init_ray
context = init_ray(address="local", num_cpus=0, include_dashboard=False,
                   _node_ip_address="127.0.0.1", _temp_dir=sys.argv[1])
print("GCS", context.address_info["gcs_address"], flush=True)
sys.stdin.read()
"""


@pytest.mark.slow(reason="a token-authenticated Ray head of its own, and four CLI processes")
@pytest.mark.timeout(300)
def test_status_names_an_authentication_failure_in_one_line_fast():
    """On a Ray head of this test's own, in its own process group and stopped by killing
    that group (``ray stop`` would stop every Ray on the machine)."""
    tmp = tempfile.mkdtemp(prefix="pxauth", dir="/tmp")  # short: Ray's socket paths are capped
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    env.update(PYTHONPATH=ROOT, HOME=tmp)  # HOME: no ~/.ray/auth_token of the machine's
    token = secrets.token_hex(32)
    log = Path(tmp) / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen(
            [sys.executable, "-c", _TOKEN_HEAD, f"{tmp}/ray"],
            env=dict(env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    address = ""

    def status_cli(**extra: str) -> tuple[subprocess.CompletedProcess, float]:
        start = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "phalanx.cli", "status", "--address", address],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(env, **extra),
        )
        return out, time.monotonic() - start

    try:
        assert until(lambda: "GCS " in log.read_text(), timeout=240), log.read_text()[-3000:]
        address = log.read_text().split("GCS ", 1)[1].split()[0]
        failed = f"phalanx status: authentication failed at {address!r}: "
        out, took = status_cli(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token")
        assert out.returncode == status.RUNTIME_FAILURE == 4, out.stderr[-2000:]
        assert out.stdout.splitlines() == [
            failed + f"the cluster rejected the token from RAY_AUTH_TOKEN; {status.TOKEN_HELP}"
        ]
        assert "InvalidAuthToken" not in out.stderr and took < 20, (took, out.stderr[-2000:])

        out, took = status_cli()  # token auth off in this client, no token anywhere
        assert out.returncode == 4, out.stderr[-2000:]
        assert out.stdout.splitlines() == [
            failed + f"the cluster requires a token and this client sent none; {status.TOKEN_HELP}"
        ]
        assert "InvalidAuthToken" not in out.stderr and took < 20, (took, out.stderr[-2000:])

        out, _ = status_cli(RAY_AUTH_MODE="token")  # token mode, but no token to send
        assert out.returncode == 4, out.stderr[-2000:]
        assert out.stdout.splitlines() == [
            failed + f"RAY_AUTH_MODE is 'token' but this client has no token; {status.TOKEN_HELP}"
        ]

        out, _ = status_cli(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == ["no live phalanx groups on this Ray cluster"]
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)

        def group_gone() -> bool:
            try:
                os.killpg(head.pid, 0)
            except ProcessLookupError:
                return True
            return False

        assert until(group_gone, timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.smoke
def test_status_cli_rejects_a_timeout_that_is_not_positive(capsys):
    args = argparse.Namespace(address="127.0.0.1:1", group=None, timeout=0.0, json=False)
    assert status.run(args) == status.BAD_INPUT == 1
    assert capsys.readouterr().err == "phalanx status: --timeout must be > 0, got 0\n"
    with pytest.raises(TypeError, match="timeout_s must be a number, got bool"):
        status.collect_status(timeout_s=True)
