"""Which of the driver's variables reach workers (NeMo-RL copies the driver's whole
environment into every worker; phalanx does not): a variable exported before Ray starts
reaches the workers of an embedded Ray (Ray's processes inherit it), one set in the driver
afterwards reaches them only when allowlisted (``PHALANX_*``, ``HF_*``, ...) or passed
with ``env_vars=``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, os
import ray
import phalanx as px

px.Cluster(num_cpus=4)
os.environ["PX_SET_AFTER_START"] = "late"
os.environ["PHALANX_SET_AFTER_START"] = "late"
vc = px.RayVirtualCluster([1], use_gpus=False)
g = px.RayWorkerGroup(vc, px.RayWorkerBuilder("tests.workers.Recorder"), name_prefix="drv_env",
                      env_vars={"PX_PASSED": "group"})
keys = ["PX_EXPORTED", "PX_SET_AFTER_START", "PHALANX_SET_AFTER_START", "PX_PASSED"]
print("ENV", json.dumps(ray.get(g.run_all_workers_single_data("env", *keys))))
g.shutdown()
vc.shutdown()
ray.shutdown()
"""


@pytest.mark.timeout(180)
def test_exported_variables_reach_workers_of_an_embedded_ray():
    env = {**os.environ, "PX_EXPORTED": "early"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("ENV ")][-1]
    assert json.loads(line[4:]) == [
        {
            "PX_EXPORTED": "early",
            "PX_SET_AFTER_START": None,
            "PHALANX_SET_AFTER_START": "late",
            "PX_PASSED": "group",
        }
    ]
