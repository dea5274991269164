"""How a worker's environment reaches it: ``os.environ`` set by the host, a Ray
``runtime_env`` only for pre-import variables the pooled worker processes lack."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

import phalanx as px
from phalanx.worker.builder import is_pre_import, pool_environ, pre_import_runtime_env
from tests.worker.import_env_worker import ImportTimeReader

KEYS = ("PX_ENV_B", "PX_ENV_G", "PX_ENV_C", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PHALANX_ENVTEST")


class InitEnv(px.Worker):
    """Records, in ``__init__``, the variables the test sets through every layer."""

    @staticmethod
    def configure_worker(num_gpus, bundle_indices=None, num_gpus_per_node=None):
        return None, {"PX_ENV_C": "configure"}, None, None

    def __init__(self):
        super().__init__()
        self.seen = {k: os.environ.get(k) for k in KEYS}

    def seen_in_init(self):
        return self.seen

    def runtime_env(self):
        return json.loads(ray.get_runtime_context().get_runtime_env_string())

    def string_hash(self):
        return hash("phalanx")


@pytest.mark.timeout(150)
def test_init_sees_every_layer_in_order_and_no_runtime_env(cluster):
    """Allowlisted driver < builder < group < configure_worker < rank variables, in __init__;
    none of it needs a Ray runtime_env, so Ray may hand the actors pooled processes."""
    os.environ["PHALANX_ENVTEST"] = "driver"  # allowlisted, set after Ray started
    builder = px.RayWorkerBuilder(InitEnv).with_runtime_env(
        env_vars={"PX_ENV_B": "builder", "PX_ENV_G": "builder", "PX_ENV_C": "builder"}
    )
    vc = px.RayVirtualCluster([3], use_gpus=False)
    g = px.RayWorkerGroup(
        vc, builder, name_prefix="env_init", env_vars={"PX_ENV_G": "group", "PX_ENV_C": "group"}
    )
    try:
        seen = ray.get(g.run_all_workers_single_data("seen_in_init"))
        assert seen == [
            {
                "PX_ENV_B": "builder",
                "PX_ENV_G": "group",
                "PX_ENV_C": "configure",
                "RANK": str(r),
                "WORLD_SIZE": "3",
                "LOCAL_RANK": str(r),
                "PHALANX_ENVTEST": "driver",
            }
            for r in range(3)
        ]
        assert ray.get(g.run_all_workers_single_data("runtime_env")) == [{}, {}, {}]
    finally:
        g.shutdown()
        vc.shutdown()
        os.environ.pop("PHALANX_ENVTEST", None)


@pytest.mark.timeout(150)
def test_plain_workers_get_no_runtime_env(cluster):
    """N plain workers with group env vars: no actor has a runtime_env."""
    g = InitEnv.create_group().launch(
        cluster, px.NodePlacement(num_workers=6), name="env_plain", env_vars={"PX_ENV_G": "g"}
    )
    try:
        assert g.runtime_env().wait(timeout=60) == [{}] * 6
        assert [s["PX_ENV_G"] for s in g.seen_in_init().wait(timeout=60)] == ["g"] * 6
    finally:
        g.shutdown()


@pytest.mark.timeout(150)
def test_pre_import_variable_that_differs_from_the_pool_reaches_the_interpreter(cluster):
    """PYTHONHASHSEED acts only when the interpreter starts: the string hash a worker
    computes equals that of a fresh interpreter started with the same seed."""
    assert is_pre_import("PYTHONHASHSEED") and not is_pre_import("PX_ENV_G")
    seed = "4242" if os.environ.get("PYTHONHASHSEED") != "4242" else "4243"
    expected = int(
        subprocess.run(
            [sys.executable, "-c", "print(hash('phalanx'))"],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    g = InitEnv.create_group().launch(
        cluster,
        px.NodePlacement(num_workers=2),
        name="env_pre_import",
        env_vars={"PYTHONHASHSEED": seed, "PX_ENV_G": "g"},
    )
    try:
        assert g.string_hash().wait(timeout=60) == [expected, expected]
        # Only the pre-import variable travels in the runtime_env; the rest is os.environ.
        assert g.runtime_env().wait(timeout=60) == [{"env_vars": {"PYTHONHASHSEED": seed}}] * 2
        assert [s["PX_ENV_G"] for s in g.seen_in_init().wait(timeout=60)] == ["g", "g"]
    finally:
        g.shutdown()


@pytest.mark.timeout(150)
def test_variable_read_when_the_worker_module_is_imported(cluster):
    """The worker's module is imported after the host set the environment."""
    g = ImportTimeReader.create_group().launch(
        cluster,
        px.NodePlacement(num_workers=2),
        name="env_import_time",
        env_vars={"PX_READ_AT_IMPORT": "set-by-group"},
    )
    try:
        assert g.at_import().wait(timeout=60) == ["set-by-group", "set-by-group"]
        assert g.execute_on(0).at_import().wait(timeout=60) == ["set-by-group"]
    finally:
        g.shutdown()


@pytest.mark.timeout(60)
def test_pre_import_runtime_env_compares_with_what_the_process_starts_with(cluster):
    node = ray.get_runtime_context().get_node_id()
    pool = pool_environ([node])[node]
    # conftest put PYTHONPATH in the environment before Ray started: the pool has it.
    pp = os.environ["PYTHONPATH"]
    assert pool is not None and pool.get("PYTHONPATH") == pp
    assert pre_import_runtime_env({"PYTHONPATH": pp, "PX_ENV_G": "g"}, node) == {}
    omp = str(int(pool.get("OMP_NUM_THREADS", "1")) + 6)
    assert pre_import_runtime_env({"OMP_NUM_THREADS": omp}, node) == {"OMP_NUM_THREADS": omp}
    # the actor's own runtime_env would start it with another value: send ours
    assert pre_import_runtime_env({"PYTHONPATH": pp}, node, {"PYTHONPATH": "/elsewhere"}) == {
        "PYTHONPATH": pp
    }
    # a node phalanx knows nothing of: every pre-import variable travels
    assert pre_import_runtime_env({"PYTHONPATH": pp, "PX_ENV_G": "g"}, None) == {"PYTHONPATH": pp}
