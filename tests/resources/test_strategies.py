"""RLinf's placement strategies: rank -> node/device mapping, errors, and groups launched
from them on a two-node Ray cluster with GPUs declared (node 0: 4 GPUs, node 1: 2 GPUs)."""

from __future__ import annotations

import os

import pytest
import ray
from ray.cluster_utils import Cluster as RayTestCluster

import phalanx as px
from phalanx.resources.strategies import default_placement


class PlacedWorker(px.Worker):
    """Reports where it landed, under RLinf's attribute names."""

    def where(self):
        platform = self.torch_platform
        return {
            "rank": self._rank,
            "group": self._group_name,
            "address": self._worker_address.get_name(),
            "cluster_node_rank": self._cluster_node_rank,
            "local_accelerator_rank": self._local_accelerator_rank,
            "node_local_rank": self._node_local_rank,
            "node_local_world_size": self._node_local_world_size,
            "local_rank": self._local_rank,
            "local_world_size": self._local_world_size,
            "torch_platform": None if platform is None else platform.__name__,
            "class_torch_platform": None
            if px.Worker.torch_platform is None
            else px.Worker.torch_platform.__name__,
            "env": {
                k: os.environ.get(k)
                for k in (
                    "CUDA_VISIBLE_DEVICES",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "NODE_RANK",
                    "CLUSTER_NODE_RANK",
                    "NODE_LOCAL_RANK",
                    "NODE_LOCAL_WORLD_SIZE",
                    "LOCAL_ACCELERATOR_RANK",
                    "ISOLATE_ACCELERATOR",
                    "ACCELERATOR_TYPE",
                    "RANK",
                    "WORLD_SIZE",
                )
            },
        }


@pytest.fixture
def gpu_nodes(fresh_ray):
    """Two local Ray nodes: the driver's with 4 GPUs, a second with 2 (global ranks 0-5)."""
    c = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 4})
    c.add_node(num_cpus=8, num_gpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, namespace="phalanx")
    yield px.Cluster(num_nodes=2)
    ray.shutdown()
    c.shutdown()


def _table(placements):
    return [
        (
            p.rank,
            p.cluster_node_rank,
            p.placement_node_rank,
            p.local_rank,
            p.local_world_size,
            p.local_accelerator_rank,
            p.visible_accelerators,
        )
        for p in placements
    ]


@pytest.mark.timeout(240)
def test_rank_to_device_mapping(gpu_nodes):
    cluster = gpu_nodes
    assert cluster.num_accelerators == 6
    assert [n.num_accelerators for n in cluster.nodes] == [4, 2]
    assert cluster.accelerator_ranks == [[0, 1, 2, 3], [4, 5]]

    # Packed over all GPUs: node 0 takes ranks 0-3, node 1 ranks 4-5.
    assert _table(px.PackedPlacementStrategy(0, 5).get_placement(cluster)) == [
        (0, 0, 0, 0, 4, 0, ["0"]),
        (1, 0, 0, 1, 4, 1, ["1"]),
        (2, 0, 0, 2, 4, 2, ["2"]),
        (3, 0, 0, 3, 4, 3, ["3"]),
        (4, 1, 1, 0, 2, 0, ["0"]),
        (5, 1, 1, 1, 2, 1, ["1"]),
    ]
    chunked = px.PackedPlacementStrategy(
        start_hardware_rank=0, end_hardware_rank=3, num_hardware_per_process=2
    ).get_placement(cluster)
    assert [p.visible_accelerators for p in chunked] == [["0", "1"], ["2", "3"]]
    assert [p.local_world_size for p in chunked] == [2, 2]
    strided = px.PackedPlacementStrategy(0, 3, num_hardware_per_process=2, stride=2)
    assert [p.visible_accelerators for p in strided.get_placement(cluster)] == [
        ["0", "2"],
        ["1", "3"],
    ]
    # A range starting mid-node and crossing to node 1.
    assert _table(px.PackedPlacementStrategy(2, 5, 2).get_placement(cluster)) == [
        (0, 0, 0, 0, 1, 2, ["2", "3"]),
        (1, 1, 1, 0, 1, 0, ["0", "1"]),
    ]
    assert [p.local_hardware_ranks for p in strided.get_placement(cluster)] == [[0, 2], [1, 3]]
    # Without isolation a process sees its whole node and its accelerator rank is 0.
    shared = px.PackedPlacementStrategy(3, 4).get_placement(cluster, isolate_accelerator=False)
    assert _table(shared) == [
        (0, 0, 0, 0, 1, 0, ["0", "1", "2", "3"]),
        (1, 1, 1, 0, 1, 0, ["0", "1"]),
    ]
    assert [p.isolate_accelerator for p in shared] == [False, False]
    assert {p.accelerator_type for p in shared} == {"NV_GPU"}

    # Flexible: devices sorted inside a process, processes ordered by their first device.
    flex = px.FlexiblePlacementStrategy([[5], [2, 1, 3], [0]]).get_placement(cluster)
    assert _table(flex) == [
        (0, 0, 0, 0, 2, 0, ["0"]),
        (1, 0, 0, 1, 2, 1, ["1", "2", "3"]),
        (2, 1, 1, 0, 1, 1, ["1"]),
    ]
    assert [p.local_hardware_ranks for p in flex] == [[0], [1, 2, 3], [1]]
    unisolated = px.FlexiblePlacementStrategy([[5]]).get_placement(cluster, False)
    assert _table(unisolated) == [(0, 1, 0, 0, 1, 0, ["0", "1"])]

    # Node: one process per entry (sorted), each sees every GPU of its node.
    node = px.NodePlacementStrategy([1, 0, 0]).get_placement(cluster)
    assert _table(node) == [
        (0, 0, 0, 0, 2, 0, ["0", "1", "2", "3"]),
        (1, 0, 0, 1, 2, 0, ["0", "1", "2", "3"]),
        (2, 1, 1, 0, 1, 0, ["0", "1"]),
    ]
    assert [p.isolate_accelerator for p in node] == [True, True, True]
    assert (
        px.NodePlacementStrategy([0]).get_placement(cluster, False)[0].isolate_accelerator is False
    )

    # RLinf's launch default: all GPUs, packed.
    default = default_placement(cluster)
    assert isinstance(default, px.PackedPlacementStrategy)
    assert _table(default.get_placement(cluster)) == _table(
        px.PackedPlacementStrategy(0, 5).get_placement(cluster)
    )

    # Errors RLinf raises as AssertionError / IndexError; ours are also ValueErrors.
    with pytest.raises(AssertionError, match="span"):
        px.PackedPlacementStrategy(3, 4, num_hardware_per_process=2).get_placement(cluster)
    with pytest.raises(ValueError, match="exceed"):
        px.PackedPlacementStrategy(4, 7).get_placement(cluster)
    with pytest.raises(AssertionError, match="same node"):
        px.FlexiblePlacementStrategy([[3, 4]]).get_placement(cluster)
    with pytest.raises(AssertionError, match="out of range"):
        px.FlexiblePlacementStrategy([[0], [6]]).get_placement(cluster)
    with pytest.raises(AssertionError, match="must be unique"):
        px.FlexiblePlacementStrategy([[0, 0]]).get_placement(cluster)
    with pytest.raises(IndexError, match="node rank 2"):
        px.NodePlacementStrategy([0, 2]).get_placement(cluster)
    with pytest.raises(ValueError, match="node rank 2"):
        px.NodePlacementStrategy([2]).get_placement(cluster)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: px.PackedPlacementStrategy(0, 3, stride=5), "stride = 5"),
        (lambda: px.PackedPlacementStrategy(0, 2, num_hardware_per_process=4), "= 4"),
        (lambda: px.PackedPlacementStrategy(3, 1), "end_hardware_rank"),
        (lambda: px.PackedPlacementStrategy(-1, 1), "start_hardware_rank"),
        (lambda: px.PackedPlacementStrategy(0, 1, stride=0), "stride"),
        (lambda: px.PackedPlacementStrategy(0, 1, node_group="a800"), "node_group"),
        (lambda: px.FlexiblePlacementStrategy([]), "must not be empty"),
        (lambda: px.FlexiblePlacementStrategy([[0], []]), r"hardware_ranks_list\[1\]"),
        (lambda: px.FlexiblePlacementStrategy([[-1]]), "non-negative"),
        (lambda: px.NodePlacementStrategy([]), "must not be empty"),
        (lambda: px.NodePlacementStrategy([0], node_group_label="a800"), "node_group_label"),
    ],
)
def test_strategy_bad_input(make, match):
    with pytest.raises(px.PlacementError, match=match) as info:
        make()
    assert isinstance(info.value, AssertionError) and isinstance(info.value, ValueError)


@pytest.mark.smoke
def test_strategies_on_cpu_cluster(cluster):
    placements = px.NodePlacementStrategy([0, 0]).get_placement(cluster)
    assert _table(placements) == [(0, 0, 0, 0, 2, -1, []), (1, 0, 0, 1, 2, -1, [])]
    assert {p.accelerator_type for p in placements} == {"NO_ACCEL"}
    assert isinstance(default_placement(cluster), px.NodePlacementStrategy)
    assert _table(default_placement(cluster).get_placement(cluster)) == [(0, 0, 0, 0, 1, -1, [])]
    with pytest.raises(px.PlacementError, match="no accelerators"):
        px.PackedPlacementStrategy(0, 0).get_placement(cluster)


@pytest.mark.timeout(300)
def test_groups_launched_from_strategies(gpu_nodes):
    cluster = gpu_nodes

    # Flexible, with the order RLinf gives: rank 0 holds devices 0,1 of node 0.
    g = PlacedWorker.create_group().launch(
        cluster, placement_strategy=px.FlexiblePlacementStrategy([[5], [1, 0]]), name="flex"
    )
    try:
        where = g.where().wait(timeout=120)
        assert [w["env"]["CUDA_VISIBLE_DEVICES"] for w in where] == ["0,1", "1"]
        assert [w["cluster_node_rank"] for w in where] == [0, 1]
        assert [w["local_accelerator_rank"] for w in where] == [0, 1]
        assert [w["node_local_rank"] for w in where] == [0, 0]
        assert [w["node_local_world_size"] for w in where] == [1, 1]
        # Isolated: each process sees only its devices, so LOCAL_RANK is 0 (RLinf).
        assert [w["env"]["LOCAL_RANK"] for w in where] == ["0", "0"]
        assert [w["env"]["LOCAL_WORLD_SIZE"] for w in where] == ["1", "1"]
        assert [(w["local_rank"], w["local_world_size"]) for w in where] == [(0, 1), (0, 1)]
        assert [w["env"]["NODE_RANK"] for w in where] == ["0", "1"]
        assert [w["env"]["ISOLATE_ACCELERATOR"] for w in where] == ["1", "1"]
        assert [w["env"]["LOCAL_ACCELERATOR_RANK"] for w in where] == ["0", "1"]
        assert [w["group"] for w in where] == ["flex", "flex"]
        assert [w["address"] for w in where] == ["flex:0", "flex:1"]
        assert {w["torch_platform"] for w in where} == {"torch.cuda"}
        assert {w["class_torch_platform"] for w in where} == {"torch.cuda"}
        assert g.worker_metadata[0]["gpu_ids"] == [0, 1]
    finally:
        g.shutdown()

    # Two groups on the same devices at once (RLinf's collocated mode): no GPU reserved.
    a = PlacedWorker.create_group().launch(
        cluster, placement_strategy=px.PackedPlacementStrategy(4, 5), name="colo_a"
    )
    b = PlacedWorker.create_group().launch(
        cluster, placement_strategy=px.PackedPlacementStrategy(4, 5), name="colo_b"
    )
    try:
        for grp in (a, b):
            where = grp.where().wait(timeout=120)
            assert [(w["cluster_node_rank"], w["env"]["CUDA_VISIBLE_DEVICES"]) for w in where] == [
                (1, "0"),
                (1, "1"),
            ]
            assert [w["env"]["NODE_RANK"] for w in where] == ["0", "0"]
            assert [w["env"]["CLUSTER_NODE_RANK"] for w in where] == ["1", "1"]
            assert [w["env"]["NODE_LOCAL_WORLD_SIZE"] for w in where] == ["2", "2"]
    finally:
        a.shutdown()
        b.shutdown()

    # Node placement: every process sees its node's GPUs.
    g = PlacedWorker.create_group().launch(
        cluster, placement_strategy=px.NodePlacementStrategy([1, 0]), name="nodes"
    )
    try:
        where = g.where().wait(timeout=120)
        assert [w["env"]["CUDA_VISIBLE_DEVICES"] for w in where] == ["0,1,2,3", "0,1"]
        assert [w["cluster_node_rank"] for w in where] == [0, 1]
        assert [w["local_accelerator_rank"] for w in where] == [0, 0]
        assert [w["env"]["RANK"] for w in where] == ["0", "1"]
        assert [w["env"]["WORLD_SIZE"] for w in where] == ["2", "2"]
    finally:
        g.shutdown()


@pytest.mark.timeout(120)
def test_worker_attributes_on_cpu(cluster):
    g = PlacedWorker.create_group().launch(
        cluster, placement_strategy=px.NodePlacementStrategy([0, 0]), name="rlinf_attrs"
    )
    try:
        where = g.where().wait(timeout=60)
        assert [w["rank"] for w in where] == [0, 1]
        assert [w["group"] for w in where] == ["rlinf_attrs"] * 2
        assert [w["address"] for w in where] == ["rlinf_attrs:0", "rlinf_attrs:1"]
        assert [w["cluster_node_rank"] for w in where] == [0, 0]
        assert [w["local_accelerator_rank"] for w in where] == [-1, -1]
        assert [w["node_local_rank"] for w in where] == [0, 1]
        assert [w["node_local_world_size"] for w in where] == [2, 2]
        assert [w["torch_platform"] for w in where] == [None, None]
        assert [w["class_torch_platform"] for w in where] == [None, None]
        assert [w["env"]["ACCELERATOR_TYPE"] for w in where] == ["NO_ACCEL"] * 2
        assert [w["env"]["CUDA_VISIBLE_DEVICES"] for w in where] == [None, None]
        # Isolated (RLinf's default): LOCAL_RANK 0 in every process.
        assert [w["env"]["LOCAL_RANK"] for w in where] == ["0", "0"]
        assert [w["env"]["NODE_LOCAL_RANK"] for w in where] == ["0", "1"]
    finally:
        g.shutdown()
