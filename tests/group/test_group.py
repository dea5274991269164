"""RLinf face of WorkerGroup: launch, method fan-out, execute_on, handles, timers, errors."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray

import phalanx as px


class Echo(px.Worker):
    def __init__(self, k: int = 1):
        super().__init__()
        self.k = k
        self.seen_env_at_init = os.environ.get("RANK"), self.rank

    def hello(self):
        return self.rank

    def scaled(self, x):
        return self.rank * self.k + x

    def init_env(self):
        return self.seen_env_at_init

    @px.Worker.timer("step")
    def step(self):
        with self.worker_timer("inner"):
            time.sleep(0.02 * (self.rank + 1))
        return self.rank

    def gen(self, n):
        for i in range(n):
            yield self.rank * 100 + i

    async def ahello(self, delay: float = 0.01):
        await asyncio.sleep(delay)
        return self.rank

    def uses_asyncio_run(self):
        async def inner():
            await asyncio.sleep(0)
            return self.rank

        return asyncio.run(inner())

    def fail(self):
        raise KeyError(f"missing on {self.rank}")

    def slow(self, s):
        time.sleep(s)
        return self.rank

    def allreduce(self):
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return t.item()


@pytest.fixture(scope="module")
def echo(cluster):
    g = Echo.create_group(3).launch(cluster, placement=px.NodePlacement(num_workers=4), name="echo")
    yield g
    g.shutdown()


@pytest.mark.smoke
def test_fan_out_and_execute_on(echo):
    assert echo.hello().wait() == [0, 1, 2, 3]
    assert echo.execute_on(0, 3).hello().wait() == [0, 3]
    assert echo.execute_on([2]).scaled(1).wait() == [7]
    # execute_on narrows only the call made through it
    assert echo.hello().wait() == [0, 1, 2, 3]


def test_handle_await_and_done(echo):
    async def main():
        return await echo.hello()

    assert asyncio.run(main()) == [0, 1, 2, 3]
    h = echo.slow(0.3)
    assert not h.done()
    assert h.wait(timeout=30) == [0, 1, 2, 3]
    assert h.done()


def test_rank_environment_before_init(echo):
    assert echo.init_env().wait() == [(str(r), r) for r in range(4)]
    assert echo.call("init_env").wait() == [(str(r), r) for r in range(4)]
    assert echo.call("init_env", ranks=[1, 3]).wait() == [("1", 1), ("3", 3)]


def test_torch_distributed_from_environment(echo):
    # RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are enough for init_process_group("gloo").
    assert echo.allreduce().wait(timeout=120) == [10.0] * 4


def test_timers_nested_and_reduced(echo):
    h = echo.step()
    assert h.wait() == [0, 1, 2, 3]
    d = h.consume_durations()
    assert set(d) == {"step", "inner"}
    assert d["step"] >= d["inner"] >= 0.08  # rank 3 sleeps 0.08 s and max is the default
    h2 = echo.step()
    h2.wait()
    mins = h2.consume_durations(reduce="min")
    assert 0.02 <= mins["inner"] < d["inner"]
    # durations were consumed: a plain call afterwards has none
    h3 = echo.hello()
    h3.wait()
    assert h3.consume_durations() == {}
    with pytest.raises(ValueError, match="reduce"):
        px.reduce_durations([{"a": 1.0}], reduce="median")


def test_generator_and_async_methods(echo):
    assert echo.gen(3).wait() == [[0, 1, 2], [100, 101, 102], [200, 201, 202], [300, 301, 302]]
    assert echo.ahello().wait() == [0, 1, 2, 3]
    assert echo.uses_asyncio_run().wait() == [0, 1, 2, 3]


@pytest.mark.smoke
def test_error_names_group_rank_method_and_traceback(echo):
    with pytest.raises(px.WorkerError) as info:
        echo.execute_on(2).fail().wait()
    err = info.value
    assert (err.group, err.rank, err.method, err.cause_type) == ("echo", 2, "fail", "KeyError")
    assert "missing on 2" in str(err) and "test_group.py" in err.remote_traceback
    # the worker is still usable after a user exception
    assert echo.execute_on(2).hello().wait() == [2]


def test_unknown_method_and_bad_ranks_fail_before_remote_work(echo):
    with pytest.raises(AttributeError, match="nope"):
        echo.nope()
    with pytest.raises(ValueError, match="method_name 'nope'"):
        echo.run_all_workers_single_data("nope")
    with pytest.raises(ValueError, match=r"ranks \[7\]"):
        echo.execute_on(0, 7)
    with pytest.raises(ValueError, match="at least one rank"):
        echo.execute_on()


def test_wait_timeout_names_pending_ranks(echo):
    h = echo.execute_on(1, 2).slow(3)
    with pytest.raises(px.GroupTimeoutError) as info:
        h.wait(timeout=0.3)
    assert info.value.pending_ranks == [1, 2]
    assert h.wait(timeout=60) == [1, 2]


def test_duplicate_name_rejected(cluster, echo):
    with pytest.raises(ValueError, match="name 'echo'"):
        Echo.create_group().launch(cluster, placement=px.NodePlacement(num_workers=1), name="echo")


def test_default_placement_and_addresses(cluster):
    g = Echo.create_group().launch(cluster, name="default_place")
    try:
        # no GPUs in the session cluster: one CPU worker per node
        assert g.world_size == cluster.num_nodes == 1
        md = g.worker_metadata[0]
        assert md["name"] == "default_place:0" and md["node_idx"] == 0
        named = ray.get_actor("default_place:0", namespace="phalanx")
        assert named._actor_id == g.actors[0]._actor_id
    finally:
        g.shutdown()


def test_worker_info_and_address(cluster):
    from tests.workers import Recorder

    g = Recorder.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="infos"
    )
    try:
        infos = g.info().wait()
        assert [i["rank"] for i in infos] == [0, 1]
        assert [i["address"] for i in infos] == ["infos:0", "infos:1"]
        assert [i["local_rank"] for i in infos] == [0, 1]
        assert all(i["node_id"] == 0 and i["gpu_id"] is None for i in infos)
    finally:
        g.shutdown()


def test_resource_request_beyond_cluster_fails_fast(cluster):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="CPU"):
        Echo.create_group().launch(
            cluster, placement=px.NodePlacement(num_workers=40), name="too_big"
        )
    assert time.monotonic() - t0 < 5


def test_worker_address():
    a = px.WorkerAddress("grp", 3)
    assert a.get_name() == "grp:3" and a.rank == 3
    assert a.get_parent_rank() == 0 and a.get_parent_address() == px.WorkerAddress("grp")
    child = a.get_child_address(1)
    assert child.get_name() == "grp:3:1" and child.get_parent_rank() == 3
    assert child.get_parent_address() == a
    assert px.WorkerAddress.from_name("grp:3:1") == child
    assert px.WorkerAddress("grp").get_parent_address() is None
    with pytest.raises(ValueError, match="':'"):
        px.WorkerAddress("a:b", 0)


def test_worker_outside_group_is_rank_zero():
    w = Echo(2)
    assert (w.rank, w.world_size) == (0, 1)
    with w.worker_timer("t"):
        pass
    assert w.get_name().startswith("local_Echo")
