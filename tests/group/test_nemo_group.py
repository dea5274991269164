"""NeMo-RL face: RayVirtualCluster + RayWorkerGroup + every dispatch mode, with exact
assertions of who was called with what and who returned."""

from __future__ import annotations

import numpy as np
import pytest
import ray

import phalanx as px


@pytest.fixture(scope="module")
def vc(cluster):
    v = px.RayVirtualCluster([2, 2], use_gpus=False, max_colocated_worker_groups=2, name="nemo_vc")
    yield v
    v.shutdown()


@pytest.fixture(scope="module")
def wg(vc):
    g = px.RayWorkerGroup(
        vc,
        px.RayWorkerBuilder("tests.workers.Recorder", "nemo"),
        name_prefix="nemo",
        sharding_annotations=px.NamedSharding([[0, 1], [2, 3]], ["dp", "tp"]),
    )
    yield g
    g.shutdown()


def _calls(wg):
    """Every worker's recorded calls since the last look (then cleared by re-reading)."""
    out = ray.get([w.get_calls.remote() for w in wg.workers])
    return out


@pytest.fixture
def fresh_calls(wg):
    before = [len(c) for c in _calls(wg)]

    def new():
        return [c[n:] for c, n in zip(_calls(wg), before)]

    return new


@pytest.mark.smoke
def test_layout(wg):
    assert wg.world_size == 4 and wg.dp_size == 4
    assert [m["node_idx"] for m in wg.worker_metadata] == [0, 0, 0, 0]
    assert [m["name"] for m in wg.worker_metadata] == [f"nemo:{r}" for r in range(4)]
    assert wg.sharding_annotations.get_worker_coords(3) == {"dp": 1, "tp": 1}


@pytest.mark.smoke
def test_sharded_dp_replicated_tp(wg, fresh_calls):
    fut = wg.run_all_workers_sharded_data(
        "record",
        data=["shard0", "shard1"],
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
        output_is_replicated=["tp"],
        common_kwargs={"lr": 0.1},
    )
    assert fut.called_workers == [0, 1, 2, 3]
    assert fut.return_from_workers == [0, 2]
    results = fut.get_results(wg)
    assert [r["rank"] for r in results] == [0, 2]
    assert [r["kwargs"] for r in results] == [
        {"data": "shard0", "lr": 0.1},
        {"data": "shard1", "lr": 0.1},
    ]
    calls = fresh_calls()
    assert [c[0][2]["data"] for c in calls] == ["shard0", "shard0", "shard1", "shard1"]
    assert wg.get_all_worker_results(fut) == results


def test_sharded_free_axis_only_index_zero(wg, fresh_calls):
    fut = wg.run_all_workers_sharded_data("record", data=["a", "b"], in_sharded_axes=["dp"])
    assert fut.called_workers == [0, 2]
    assert fut.return_from_workers == [0, 2]
    assert [r["kwargs"]["data"] for r in fut.get_results(wg)] == ["a", "b"]
    assert [len(c) for c in fresh_calls()] == [1, 0, 1, 0]


def test_sharded_dummy_calls_to_free_axes(wg, fresh_calls):
    fut = wg.run_all_workers_sharded_data(
        "record", data=["a", "b"], in_sharded_axes=["dp"], make_dummy_calls_to_free_axes=True
    )
    assert fut.called_workers == [0, 1, 2, 3]
    assert fut.return_from_workers == [0, 2]
    calls = fresh_calls()
    assert [c[0][2]["data"] for c in calls] == ["a", None, "b", None]


def test_sharded_over_two_axes(wg, fresh_calls):
    data = [["d0t0", "d0t1"], ["d1t0", "d1t1"]]
    fut = wg.run_all_workers_sharded_data("record", data=data, in_sharded_axes=["dp", "tp"])
    assert fut.called_workers == [0, 1, 2, 3]
    assert [r["kwargs"]["data"] for r in fut.get_results(wg)] == ["d0t0", "d0t1", "d1t0", "d1t1"]


def test_sharded_batched_data_dict_is_split(wg):
    import torch

    batch = px.BatchedDataDict({"x": torch.arange(8)})
    fut = wg.run_all_workers_sharded_data(
        "record",
        data=batch,
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
        output_is_replicated=["tp"],
    )
    got = [r["kwargs"]["data"]["x"].tolist() for r in fut.get_results(wg)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_sharded_generators(wg):
    fut = wg.run_all_workers_sharded_data("stream", n=[2, 3], in_sharded_axes=["dp"])
    assert fut.get_results(wg) == [(0, 0), (0, 1), (2, 0), (2, 1), (2, 2)]
    fut2 = wg.run_all_workers_sharded_data(
        "stream",
        n=[1, 1],
        in_sharded_axes=["dp"],
        replicate_on_axes=["tp"],
        output_is_replicated=["tp"],
    )
    proxies = fut2.get_results(wg, return_generators_as_proxies=True)
    assert len(proxies) == 2 and all(isinstance(p, ray.ObjectRefGenerator) for p in proxies)
    assert [ray.get(next(p)) for p in proxies] == [(0, 0), (2, 0)]


def test_single_data_and_rank0_axes(wg, fresh_calls):
    refs = wg.run_all_workers_single_data("record", x=1)
    assert [r["rank"] for r in ray.get(refs)] == [0, 1, 2, 3]
    refs = wg.run_all_workers_single_data("record", run_rank_0_only_axes=["tp"], x=2)
    assert [r["rank"] for r in ray.get(refs)] == [0, 2]
    assert [len(c) for c in fresh_calls()] == [2, 1, 2, 1]


def test_multiple_data(wg, fresh_calls):
    refs = wg.run_all_workers_multiple_data("record", x=[10, 11, 12, 13], common_kwargs={"c": 5})
    assert [r["kwargs"] for r in ray.get(refs)] == [{"x": 10 + i, "c": 5} for i in range(4)]
    refs = wg.run_all_workers_multiple_data("record", x=["p", "q"], run_rank_0_only_axes=["tp"])
    assert [(r["rank"], r["kwargs"]["x"]) for r in ray.get(refs)] == [(0, "p"), (2, "q")]


def test_single_worker(wg):
    ref = wg.run_single_worker_single_data("record", 3, y=4)
    assert ray.get(ref) == {"rank": 3, "args": (), "kwargs": {"y": 4}}
    assert ray.get(wg.workers[1].record.remote(5))["args"] == (5,)


def test_bad_input_raises_before_any_remote_call(wg, fresh_calls):
    with pytest.raises(ValueError, match="unknown axes"):
        wg.run_all_workers_sharded_data("record", data=[1, 2], in_sharded_axes=["pp"])
    with pytest.raises(ValueError, match="overlap"):
        wg.run_all_workers_sharded_data(
            "record", data=[1, 2], in_sharded_axes=["dp"], replicate_on_axes=["dp"]
        )
    with pytest.raises(ValueError, match="size 2, got 3"):
        wg.run_all_workers_sharded_data("record", data=[1, 2, 3], in_sharded_axes=["dp"])
    with pytest.raises(TypeError, match="list of 2 shards"):
        wg.run_all_workers_sharded_data("record", data="oops", in_sharded_axes=["dp"])
    with pytest.raises(ValueError, match="3 entries for 4"):
        wg.run_all_workers_multiple_data("record", x=[1, 2, 3])
    with pytest.raises(ValueError, match="run_rank_0_only_axes"):
        wg.run_all_workers_single_data("record", run_rank_0_only_axes=["zz"])
    with pytest.raises(ValueError, match="method_name 'nope'"):
        wg.run_all_workers_sharded_data("nope", data=[1, 2], in_sharded_axes=["dp"])
    with pytest.raises(ValueError, match="worker_idx"):
        wg.run_single_worker_single_data("record", 9)
    with pytest.raises(IndexError, match="dp_shard_idx"):
        wg.get_dp_leader_worker_idx(4)
    assert fresh_calls() == [[], [], [], []]


def test_default_sharding_is_dp(cluster):
    vc = px.RayVirtualCluster([3], use_gpus=False, name="dp_only")
    g = px.RayWorkerGroup(
        vc, px.RayWorkerBuilder("tests.workers.PlainWorker", {"a": 1}), name_prefix="plain"
    )
    try:
        assert g.sharding_annotations.names == ["dp"] and g.sharding_annotations.size == 3
        assert ray.get(g.run_all_workers_single_data("get_cfg")) == [{"a": 1}] * 3
        assert ray.get(g.run_all_workers_single_data("rank_env")) == [(0, 3), (1, 3), (2, 3)]
        fut = g.run_all_workers_sharded_data("get_cfg", in_sharded_axes=["dp"])
        assert fut.called_workers == [0, 1, 2]
    finally:
        g.shutdown()
        vc.shutdown()


def test_tied_workers_and_workers_per_node(vc):
    g = px.RayWorkerGroup(
        vc,
        px.RayWorkerBuilder("tests.workers.Recorder"),
        name_prefix="tied",
        bundle_indices_list=[(0, [0, 1]), (1, [0, 1])],
    )
    try:
        assert g.dp_leader_worker_indices == [0, 2] and g.dp_size == 2
        assert g.get_dp_leader_worker_idx(1) == 2
        assert [m["dp_shard_idx"] for m in g.worker_metadata] == [0, 0, 1, 1]
        assert [m["bundle_indices"] for m in g.worker_metadata] == [
            (0, [0, 1]),
            None,
            (1, [0, 1]),
            None,
        ]
    finally:
        g.shutdown()
    g2 = px.RayWorkerGroup(
        vc, px.RayWorkerBuilder("tests.workers.Recorder"), workers_per_node=1, name_prefix="wpn"
    )
    try:
        assert g2.world_size == 2
    finally:
        g2.shutdown()
    with pytest.raises(ValueError, match="workers_per_node"):
        px.RayWorkerGroup(
            vc,
            px.RayWorkerBuilder("tests.workers.Recorder"),
            workers_per_node=[1],
            name_prefix="bad",
        )


def test_shutdown_cleanup_result_and_name_reuse(vc):
    builder = px.RayWorkerBuilder("tests.workers.Recorder")
    g = px.RayWorkerGroup(vc, builder, workers_per_node=1, name_prefix="cleanup")
    assert g.shutdown(cleanup_method="cleanup") is True
    g = px.RayWorkerGroup(vc, builder, workers_per_node=1, name_prefix="cleanup")
    assert g.shutdown(cleanup_method="fail") is False  # raises in the workers
    g = px.RayWorkerGroup(vc, builder, workers_per_node=1, name_prefix="cleanup")
    assert g.shutdown(cleanup_method="sleep", timeout=0.5) is False  # sleep() needs an argument
    assert g.shutdown() is True


def test_full_bundles_fail_fast(vc, wg):
    import time

    g = px.RayWorkerGroup(vc, px.RayWorkerBuilder("tests.workers.Recorder"), name_prefix="second")
    try:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="another group holds"):
            px.RayWorkerGroup(
                vc, px.RayWorkerBuilder("tests.workers.Recorder"), name_prefix="third"
            )
        assert time.monotonic() - t0 < 10
    finally:
        g.shutdown()


def test_big_shared_payload_arrives_as_value(wg):
    payload = np.arange(1 << 18, dtype=np.int64)  # 2 MB, shared by all 4 workers
    results = ray.get(wg.run_all_workers_single_data("record", payload))
    for r in results:
        assert isinstance(r["args"][0], np.ndarray) and np.array_equal(r["args"][0], payload)
