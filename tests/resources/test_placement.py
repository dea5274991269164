"""Placement strategies, several nodes (ray.cluster_utils) and GPUs declared to Ray."""

from __future__ import annotations

import time

import pytest
import ray
from ray.cluster_utils import Cluster as RayTestCluster

import phalanx as px


@pytest.mark.smoke
def test_packed_device_order():
    assert px.PackedPlacement(0, 3).devices_per_rank() == [[0], [1], [2], [3]]
    assert px.PackedPlacement(0, 3, num_devices_per_process=2).devices_per_rank() == [
        [0, 1],
        [2, 3],
    ]
    assert px.PackedPlacement(0, 7, num_devices_per_process=2, stride=2).devices_per_rank() == [
        [0, 2],
        [1, 3],
        [4, 6],
        [5, 7],
    ]
    assert px.PackedPlacement(4, 5).devices_per_rank() == [[4], [5]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(start_device=0, end_device=2, num_devices_per_process=2), "end_device"),
        (dict(start_device=3, end_device=1), "start_device"),
        (dict(start_device=0, end_device=1, stride=0), "stride"),
        (dict(start_device=0, end_device=1, num_devices_per_process=0), "num_devices_per_process"),
    ],
)
def test_packed_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        px.PackedPlacement(**kwargs)


@pytest.mark.smoke
def test_flexible_and_node_bad_input():
    with pytest.raises(ValueError, match="appears twice"):
        px.FlexiblePlacement([[0], [0]])
    with pytest.raises(ValueError, match="devices_per_process"):
        px.FlexiblePlacement([])
    with pytest.raises(ValueError, match="num_workers"):
        px.NodePlacement(num_workers=0)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: px.NodePlacement(num_workers="2"), "num_workers"),
        (lambda: px.NodePlacement(num_workers=True), "num_workers"),
        (lambda: px.NodePlacement(num_workers=1, num_cpus="1"), "num_cpus"),
        (lambda: px.PackedPlacement("0", 1), "start_device"),
        (lambda: px.PackedPlacement(0, 1.0), "end_device"),
        (lambda: px.PackedPlacement(0, 1, stride=None), "stride"),
    ],
)
def test_placement_wrong_types_raise_type_error(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_gpu_placement_needs_gpus(cluster):
    with pytest.raises(ValueError, match="no GPUs"):
        px.PackedPlacement(0, 1).slots(cluster)


@pytest.fixture
def two_nodes(fresh_ray):
    """Two local Ray nodes, each with 2 GPUs and 4 CPUs declared."""
    c = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2})
    c.add_node(num_cpus=4, num_gpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="phalanx")
    yield px.Cluster(num_nodes=2)
    ray.shutdown()
    c.shutdown()


@pytest.mark.timeout(300)
def test_multinode_gpu_placement(two_nodes):
    cluster = two_nodes
    from tests.workers import Recorder

    assert cluster.num_nodes == 2 and cluster.num_gpus == 4 and cluster.num_gpus_per_node == 2
    assert cluster.nodes[0].is_driver_node

    # default: one worker per GPU, ranks follow global device order
    g = Recorder.create_group().launch(cluster, name="gpus")
    try:
        infos = g.info().wait(timeout=120)
        assert [(i["node_id"], i["cuda"]) for i in infos] == [
            (0, "0"),
            (0, "1"),
            (1, "0"),
            (1, "1"),
        ]
        assert [i["local_rank"] for i in infos] == [0, 1, 0, 1]
        assert [i["available_gpus"] for i in infos] == [[0], [1], [0], [1]]
        env = g.env("RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR").wait()
        assert [e["NODE_RANK"] for e in env] == ["0", "0", "1", "1"]
        assert len({e["MASTER_ADDR"] for e in env}) == 1
    finally:
        g.shutdown()

    # packed with two devices per process and a stride
    g = Recorder.create_group().launch(
        cluster, placement=px.PackedPlacement(0, 3, num_devices_per_process=2), name="packed"
    )
    try:
        infos = g.info().wait(timeout=120)
        assert [(i["node_id"], i["cuda"]) for i in infos] == [(0, "0,1"), (1, "0,1")]
    finally:
        g.shutdown()

    # explicit device lists; a rank may not span nodes
    with pytest.raises(ValueError, match="spans several nodes"):
        Recorder.create_group().launch(
            cluster, placement=px.FlexiblePlacement([[1, 2]]), name="bad"
        )
    g = Recorder.create_group().launch(
        cluster, placement=px.FlexiblePlacement([[3], [0]]), name="flex"
    )
    try:
        infos = g.info().wait(timeout=120)
        assert [(i["node_id"], i["cuda"]) for i in infos] == [(1, "1"), (0, "0")]
    finally:
        g.shutdown()

    # CPU workers spread node by node, earlier nodes take the remainder
    g = Recorder.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=3), name="cpu"
    )
    try:
        assert [i["node_id"] for i in g.info().wait(timeout=120)] == [0, 0, 1]
    finally:
        g.shutdown()

    # NeMo-RL form with GPUs: fractional GPUs for two co-located groups
    vc = px.RayVirtualCluster(
        [2, 2], use_gpus=True, num_gpus_per_node=2, max_colocated_worker_groups=2
    )
    a = px.RayWorkerGroup(vc, px.RayWorkerBuilder(Recorder), name_prefix="colo_a")
    b = px.RayWorkerGroup(vc, px.RayWorkerBuilder(Recorder), name_prefix="colo_b")
    try:
        ga = [m["gpu_ids"] for m in a.worker_metadata]
        gb = [m["gpu_ids"] for m in b.worker_metadata]
        assert ga == gb and all(len(x) == 1 for x in ga)
        assert sorted(m["node_idx"] for m in a.worker_metadata) == [0, 0, 1, 1]
    finally:
        a.shutdown()
        b.shutdown()
        vc.shutdown()

    # asking for more GPUs than exist fails within seconds, naming what is missing
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="GPU"):
        px.RayVirtualCluster([2, 2, 2], use_gpus=True, num_gpus_per_node=2)
    with pytest.raises(ValueError, match="GPU"):
        px.RayVirtualCluster([4], use_gpus=True, num_gpus_per_node=4)
    assert time.monotonic() - t0 < 5


@pytest.mark.slow(reason="25 create-and-shutdown cycles of a virtual cluster and a group")
@pytest.mark.timeout(600)
def test_create_shutdown_cycles_leave_nothing_behind(cluster):
    from tests.workers import Recorder

    before_actors = set(_named_actors())
    for i in range(25):
        vc = px.RayVirtualCluster([1], use_gpus=False, name=f"cycle{i}")
        g = px.RayWorkerGroup(vc, px.RayWorkerBuilder(Recorder), name_prefix="cycle")
        assert g.run_all_workers_single_data("noop") is not None
        assert g.shutdown() is True
        vc.shutdown()
    assert set(_named_actors()) == before_actors
    table = ray.util.placement_group_table()
    live = [
        pg for pg in table.values() if pg["name"].startswith("cycle") and pg["state"] != "REMOVED"
    ]
    assert live == []


def _named_actors() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
