"""RayWorkerBuilder: isolated initializer, configure_worker, environment precedence."""

from __future__ import annotations

import os

import pytest
import ray

import phalanx as px


def test_env_allowlist_and_precedence(cluster):
    os.environ["PHALANX_TEST_ALLOWED"] = "driver"  # allowlisted prefix, set after Ray started
    os.environ["PX_TEST_NOT_ALLOWED"] = "driver"
    os.environ["PX_TEST_LAYER"] = "driver"  # not allowlisted: never reaches workers
    try:
        from tests.workers import Recorder

        g = Recorder.create_group().launch(
            cluster, placement=px.NodePlacement(num_workers=1), name="envs"
        )
        try:
            env = g.env("PHALANX_TEST_ALLOWED", "PX_TEST_NOT_ALLOWED", "PX_TEST_LAYER").wait()[0]
            assert env == {
                "PHALANX_TEST_ALLOWED": "driver",
                "PX_TEST_NOT_ALLOWED": None,
                "PX_TEST_LAYER": None,
            }
        finally:
            g.shutdown()

        # configure_worker < builder < group env_vars, rank variables always win
        def layers(builder_env, group_env):
            b = px.RayWorkerBuilder("tests.workers.Configured")
            if builder_env:
                b.with_runtime_env(env_vars=builder_env)
            vc = px.RayVirtualCluster([1], use_gpus=False)
            grp = px.RayWorkerGroup(vc, b, name_prefix="layers", env_vars=group_env)
            try:
                return ray.get(grp.run_all_workers_single_data("get"))[0]
            finally:
                grp.shutdown()
                vc.shutdown()

        assert layers(None, None) == (7, "configure", "c")
        assert layers({"PX_TEST_LAYER": "builder"}, None) == (7, "builder", "c")
        assert layers({"PX_TEST_LAYER": "builder"}, {"PX_TEST_LAYER": "group"}) == (7, "group", "c")
    finally:
        for k in ("PHALANX_TEST_ALLOWED", "PX_TEST_NOT_ALLOWED", "PX_TEST_LAYER"):
            os.environ.pop(k, None)


def test_rank_variables_cannot_be_overridden(cluster):
    with pytest.raises(ValueError, match="RANK"):
        px.RayWorkerBuilder("tests.workers.Recorder").with_runtime_env(env_vars={"RANK": "5"})
    from tests.workers import Recorder

    with pytest.raises(ValueError, match="MASTER_PORT"):
        Recorder.create_group().launch(cluster, name="x", env_vars={"MASTER_PORT": "1"})


def test_builder_bad_input():
    with pytest.raises(ValueError, match="module.Class"):
        px.RayWorkerBuilder("NoDots")
    with pytest.raises(TypeError, match="ray_actor_class_fqn"):
        px.RayWorkerBuilder(42)
    with pytest.raises(ValueError, match="py_executable"):
        px.RayWorkerBuilder("a.B").with_runtime_env(py_executable="/no/such/python")


def test_builder_call_and_async_with_initializer(cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=30)
    try:
        b = px.RayWorkerBuilder("tests.workers.PlainWorker", {"k": 1})
        ref, initializer = b.create_worker_async(
            pg, 0, 0, name="builder_async:0", namespace="phalanx"
        )
        assert initializer is not None  # the class was given by name: the driver never imported it
        actor = ray.get(ref, timeout=60)
        assert ray.get(actor._px_call.remote("get_cfg"), timeout=60) == {"k": 1}
        ray.kill(actor)
        ray.kill(initializer)
    finally:
        remove_placement_group(pg)


def test_worker_init_failure_names_rank(cluster):
    b = px.RayWorkerBuilder("tests.workers.Configured", "not-an-int-but-ok", "too", "many")
    vc = px.RayVirtualCluster([1], use_gpus=False)
    try:
        with pytest.raises(px.WorkerError) as info:
            px.RayWorkerGroup(vc, b, name_prefix="initfail")
        assert info.value.rank == 0 and info.value.method == "__init__"
        assert "TypeError" in str(info.value)
    finally:
        vc.shutdown()
