"""A driver killed with SIGKILL takes its group's named actors with it.

The driver is a separate process joined to the test's Ray. It launches a group, writes the
workers' pids to a file and then waits on its stdin; the test kills it once the file is
there and polls the GCS's named-actor table (with a deadline) until no actor of the group is alive.
Three cases: workers created by the driver itself (a worker class), workers created by an
``IsolatedWorkerInitializer`` actor (a dotted class path) that the driver owns in turn, and
a class whose ``@ray.remote(lifetime="detached")`` options would make its actors outlive
the driver (phalanx's launch overrides that: group workers always fate-share).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from phalanx.resources.cluster import NAMESPACE
from tests.helpers import until

pytestmark = pytest.mark.timeout(150)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_DRIVER = """
import json, os, sys
import ray
import phalanx as px
from tests.helpers import until
from tests.workers import Recorder

address, name, mode, ready = sys.argv[1:5]
from phalanx.resources.cluster import NAMESPACE
from tests.helpers import until
ray.init(address=address, namespace=NAMESPACE)
if mode == "class":
    g = Recorder.create_group("d").launch(px.Cluster(), px.NodePlacement(num_workers=2), name)
elif mode == "fqn":  # workers created by an initializer actor the driver owns
    vc = px.RayVirtualCluster([2], use_gpus=False, name=name)
    g = px.RayWorkerGroup(vc, px.RayWorkerBuilder("tests.workers.Recorder", "d"), name_prefix=name)
else:  # a class whose Ray options ask for detached actors, placed outside any placement group
    builder = px.RayWorkerBuilder(ray.remote(lifetime="detached")(Recorder), "d")
    g = px.WorkerGroup(None, builder).launch(px.Cluster(), px.NodePlacement(num_workers=2), name)
pids = [m["pid"] for m in g.worker_metadata]
with open(ready + ".tmp", "w") as f:
    json.dump(pids, f)
os.rename(ready + ".tmp", ready)
sys.stdin.read()  # hold the group until killed
"""


def _alive_actors(name: str) -> list[str]:
    """Names of the group's actors that Ray's GCS still registers (any state but DEAD).

    ``ray.util.state.list_actors`` needs the dashboard, which the tests' Ray does not
    start; ``list_named_actors`` asks the GCS directly and is stricter (it also counts
    actors that are pending or restarting).
    """
    rows = ray.util.list_named_actors(all_namespaces=True)
    return sorted(r["name"] for r in rows if r["name"].startswith(f"{name}:"))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("mode", ["class", "fqn", "detached"])
def test_killed_driver_leaves_no_group_actors(cluster, tmp_path, mode):
    name = f"orphan_{mode}"
    ready = str(tmp_path / "ready.json")
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, address, name, mode, ready],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
    )
    try:
        started = until(lambda: os.path.exists(ready) or driver.poll() is not None, 90)
        if not os.path.exists(ready):
            driver.kill()
            out = driver.communicate(timeout=20)[0].decode(errors="replace")
            pytest.fail(f"driver did not launch its group (started={started}):\n{out[-3000:]}")
        with open(ready) as f:
            pids = json.load(f)
        assert len(pids) == 2
        assert _alive_actors(name) == [f"{name}:0", f"{name}:1"]
        # The group's names are visible to other drivers while its driver lives.
        assert ray.get_actor(f"{name}:0", namespace=NAMESPACE) is not None
        t0 = time.monotonic()
        os.kill(driver.pid, signal.SIGKILL)
        assert driver.wait(timeout=20) == -signal.SIGKILL
        assert until(lambda: _alive_actors(name) == [], 30), _alive_actors(name)
        gone_after = time.monotonic() - t0
        assert _alive_actors(name) == []
        assert until(lambda: not any(_process_alive(p) for p in pids), 30)
        print(f"{mode}: group actors gone {gone_after:.2f}s after SIGKILL of the driver")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=20)
        for left in _alive_actors(name):  # only after a failure: do not leak into other tests
            ray.kill(ray.get_actor(left, namespace=NAMESPACE), no_restart=True)
