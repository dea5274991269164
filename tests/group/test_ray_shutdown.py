"""A script that ends with ``ray.shutdown()`` after using a group (and a channel) exits 0:
phalanx's background threads are out of Ray before Ray tears its core worker down
(a thread inside ``ray.wait`` then crashed the process now and then: SIGSEGV, SIGABRT)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import threading

    import ray

    import phalanx as px


    class Echo(px.Worker):
        def hello(self):
            return self.rank


    MONITORS = ("phalanx-health-monitor", "px-monitor")


    def running():
        return sorted(t.name for t in threading.enumerate() if t.name in MONITORS)


    cluster = px.Cluster(num_cpus=2, num_gpus=0, _node_ip_address="127.0.0.1")
    g = Echo.create_group().launch(cluster, placement=px.NodePlacement(num_workers=2), name="bye")
    assert g.hello().wait() == [0, 1]
    ch = px.create_channel("bye")
    ch.put(1)
    assert ch.get(timeout=60) == 1
    print("before", running(), flush=True)
    ray.shutdown()
    print("after", running(), flush=True)
    """
)


@pytest.mark.timeout(120)
def test_ray_shutdown_after_using_a_group_stops_the_monitors_first(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("before", "after"))]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines == [
        "before ['phalanx-health-monitor', 'px-monitor']",
        "after []",
    ], proc.stdout[-3000:]
