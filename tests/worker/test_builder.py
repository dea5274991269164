"""RayWorkerBuilder: isolated initializer, configure_worker, environment precedence."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

import phalanx as px
from tests.helpers import until


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

        # builder < group env_vars < configure_worker (NeMo-RL: the worker class wins);
        # rank variables always win
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
        assert layers({"PX_TEST_LAYER": "builder"}, None) == (7, "configure", "c")
        assert layers({"PX_TEST_LAYER": "builder"}, {"PX_TEST_LAYER": "group"}) == (
            7,
            "configure",
            "c",
        )
    finally:
        for k in ("PHALANX_TEST_ALLOWED", "PX_TEST_NOT_ALLOWED", "PX_TEST_LAYER"):
            os.environ.pop(k, None)


def test_rank_variables_cannot_be_overridden(cluster):
    with pytest.raises(ValueError, match="RANK"):
        px.RayWorkerBuilder("tests.workers.Recorder").with_runtime_env(env_vars={"RANK": "5"})
    from tests.workers import Recorder

    with pytest.raises(ValueError, match="MASTER_PORT"):
        Recorder.create_group().launch(cluster, name="x", env_vars={"MASTER_PORT": "1"})


@pytest.mark.smoke
def test_builder_bad_input():
    with pytest.raises(ValueError, match="module.Class"):
        px.RayWorkerBuilder("NoDots")
    with pytest.raises(TypeError, match="ray_actor_class_fqn"):
        px.RayWorkerBuilder(42)
    with pytest.raises(TypeError, match=r"env_vars keys must be non-empty str.*\[1\]"):
        px.RayWorkerBuilder("tests.workers.Recorder").with_runtime_env(env_vars={1: "x"})
    with pytest.raises(ValueError, match="py_executable"):
        px.RayWorkerBuilder("a.B").with_runtime_env(py_executable="/no/such/python")


@pytest.mark.smoke
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


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


@pytest.mark.timeout(120)
def test_groups_of_one_class_share_an_initializer_that_a_death_replaces(cluster):
    """Groups built by name reuse one initializer per class and environment (its import is
    paid once), each group's workers get their own init arguments, and a group's shutdown
    leaves the initializer to the next group; a dead one is replaced, and its group's
    workers are restarted through the new one."""
    fqn = "tests.workers.PlainWorker"
    vc = px.RayVirtualCluster([1, 1], use_gpus=False, name="shared_init")
    groups = []
    try:
        b1, b2 = px.RayWorkerBuilder(fqn, {"k": 1}), px.RayWorkerBuilder(fqn, {"k": 2})
        first = px.RayWorkerGroup(vc, b1, name_prefix="shr_a")
        groups.append(first)
        initializer = b1.shared_initializer()
        b1.release_initializer(initializer)
        pid = _pid(initializer)
        assert first.shutdown() is True
        second = px.RayWorkerGroup(vc, b2, name_prefix="shr_b", restart_policy=px.RestartPolicy())
        groups.append(second)
        assert ray.get(second.run_all_workers_single_data("get_cfg"), timeout=60) == [
            {"k": 2},
            {"k": 2},
        ]
        same = b2.shared_initializer()
        b2.release_initializer(same)
        assert same is initializer and _pid(same) == pid
        other_env = px.RayWorkerBuilder(fqn).with_runtime_env(env_vars={"PHALANX_X": "1"})
        other = other_env.shared_initializer()
        other_env.release_initializer(other)
        assert other is not initializer and _pid(other) != pid
        ray.kill(other, no_restart=True)  # found dead by four acquires at once: one replaces it
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: other_env.shared_initializer(), range(4)))
        for h in got:
            other_env.release_initializer(h)
        assert all(h is got[0] for h in got) and got[0] is not other

        ray.kill(initializer, no_restart=True)  # it owns the workers: they die with it
        assert until(lambda: second.num_remote_worker_restarts() == 2, timeout=60)
        assert second.wait_healthy(60)
        assert ray.get(second.run_all_workers_single_data("get_cfg"), timeout=60) == [
            {"k": 2},
            {"k": 2},
        ]
        replaced = b2.shared_initializer()
        b2.release_initializer(replaced)
        assert replaced is not initializer and _pid(replaced) != pid
    finally:
        for g in groups:
            g.shutdown()
        vc.shutdown()


@pytest.mark.timeout(120)
def test_initializers_of_an_earlier_ray_session_are_dropped_not_killed(fresh_ray):
    """After ``ray.shutdown`` and ``ray.init`` (job ids restart at 1), the idle sweep drops
    the earlier session's initializers instead of killing their now invalid handles, kills
    this session's idle ones beyond the two most recently used, and a launch in the new
    session gets a new initializer."""
    fqn = "tests.workers.PlainWorker"
    ray.init(num_cpus=2, include_dashboard=False)
    old_builder = px.RayWorkerBuilder(fqn)
    old = old_builder.shared_initializer()
    old_builder.release_initializer(old)
    ray.shutdown()

    ray.init(num_cpus=2, include_dashboard=False)
    builders = [px.RayWorkerBuilder(fqn)] + [
        px.RayWorkerBuilder(fqn).with_runtime_env(env_vars={"PHALANX_X": str(i)}) for i in (1, 2)
    ]
    handles = []
    for b in builders:  # three idle ones beyond keep_idle=2: the sweep runs on each release
        handles.append(b.shared_initializer())
        b.release_initializer(handles[-1])
    assert handles[0] is not old
    pids = [_pid(h) for h in handles[1:]]  # the two most recent stay, alive
    assert len(set(pids)) == 2
    with pytest.raises(ray.exceptions.ActorDiedError):  # the oldest idle one was killed
        _pid(handles[0])
    again = builders[2].shared_initializer()
    builders[2].release_initializer(again)
    assert again is handles[2]


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


class EnvLayers(px.Worker):
    """configure_worker sets PX_ENV_C; the test sets PX_ENV_B / PX_ENV_G / PX_ENV_C elsewhere."""

    @staticmethod
    def configure_worker(num_gpus, bundle_indices=None, num_gpus_per_node=None):
        return None, {"PX_ENV_C": "configure"}, None, None

    def env(self, *keys):
        return {k: os.environ.get(k) for k in keys}


@pytest.mark.timeout(120)
def test_env_precedence_nemo_rl_face(cluster):
    """RayWorkerGroup(env_vars=...) loses to configure_worker, wins over the builder."""
    keys = ("PX_ENV_B", "PX_ENV_G", "PX_ENV_C")
    builder = px.RayWorkerBuilder("tests.worker.test_builder.EnvLayers").with_runtime_env(
        env_vars={"PX_ENV_B": "builder", "PX_ENV_G": "builder", "PX_ENV_C": "builder"}
    )
    vc = px.RayVirtualCluster([1], use_gpus=False)
    group_env = {"PX_ENV_G": "group", "PX_ENV_C": "group"}
    g = px.RayWorkerGroup(vc, builder, name_prefix="env_nemo", env_vars=group_env)
    try:
        env = ray.get(g.run_all_workers_single_data("env", *keys))[0]
        assert env == {"PX_ENV_B": "builder", "PX_ENV_G": "group", "PX_ENV_C": "configure"}
    finally:
        g.shutdown()
        vc.shutdown()

    # The same order on the RLinf face (one call path).
    r = EnvLayers.create_group().launch(
        cluster, px.NodePlacement(num_workers=1), name="env_rlinf", env_vars=group_env
    )
    try:
        assert r.env(*keys).wait(timeout=60)[0] == {
            "PX_ENV_B": None,
            "PX_ENV_G": "group",
            "PX_ENV_C": "configure",
        }
    finally:
        r.shutdown()

    # configure_worker may not set the rank variables (NeMo-RL lets it; phalanx refuses).
    with pytest.raises(ValueError, match=r"configure_worker env_vars may not set \['RANK'\]"):
        RankSetter.create_group().launch(
            cluster, px.NodePlacement(num_workers=1), name="env_rank_setter"
        )


class RankSetter(px.Worker):
    @staticmethod
    def configure_worker(num_gpus, bundle_indices=None, num_gpus_per_node=None):
        return None, {"RANK": "9"}, None, None
