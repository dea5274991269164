"""NeMo-RL's ``RayVirtualCluster(port_range_low=, port_range_high=)``, RLinf's reserved
node-group labels, and RLinf's ``Worker.torch_device_type``."""

from __future__ import annotations

import pytest
import ray

import phalanx as px
from phalanx.resources.cluster import find_free_port

LOW, HIGH = 41000, 41400


@pytest.mark.smoke
def test_find_free_port_stays_in_the_range(cluster):
    ports = [find_free_port("127.0.0.1", port_range=(LOW, HIGH)) for _ in range(5)]
    assert all(LOW <= p < HIGH for p in ports)
    assert len(set(ports)) == 5
    with pytest.raises(
        ValueError, match="port_range_high must be > port_range_low \\(10\\), got 10"
    ):
        find_free_port(port_range=(10, 10))
    with pytest.raises(TypeError, match="port_range_low must be an int"):
        find_free_port(port_range=("1", 10))


def test_virtual_cluster_port_range_is_kept_and_used_by_its_groups(cluster):
    with pytest.raises(ValueError, match="port_range_low and port_range_high go together"):
        px.RayVirtualCluster([1], use_gpus=False, port_range_low=LOW)
    vc = px.RayVirtualCluster(
        [2], use_gpus=False, name="ports_vc", port_range_low=LOW, port_range_high=HIGH
    )
    try:
        assert (vc.port_range_low, vc.port_range_high) == (LOW, HIGH)
        _, port = vc.get_available_address_and_port()
        assert LOW <= port < HIGH
        g = px.RayWorkerGroup(
            vc, px.RayWorkerBuilder("tests.workers.Recorder"), name_prefix="ports"
        )
        try:
            seen = ray.get(g.run_all_workers_single_data("env", "MASTER_PORT"))
            assert len({s["MASTER_PORT"] for s in seen}) == 1
            assert LOW <= int(seen[0]["MASTER_PORT"]) < HIGH
        finally:
            g.shutdown()
    finally:
        vc.shutdown()
    plain = px.RayVirtualCluster([1], use_gpus=False, name="noports_vc")
    try:
        assert (plain.port_range_low, plain.port_range_high) == (None, None)
    finally:
        plain.shutdown()


def test_node_placement_accepts_rlinf_reserved_labels(cluster):
    for label in ("cluster", "node"):
        strategy = px.NodePlacementStrategy([0], node_group_label=label)
        [placement] = strategy.get_placement(cluster)
        assert placement.cluster_node_rank == 0
        assert placement.node_group_label == label
    [default] = px.NodePlacementStrategy([0]).get_placement(cluster)
    assert default.node_group_label == "cluster"
    with pytest.raises(px.PlacementError, match="node_group_label='gpu_nodes': phalanx has no"):
        px.NodePlacementStrategy([0], node_group_label="gpu_nodes")
    with pytest.raises(px.PlacementError, match="node_group='node'"):
        px.PackedPlacementStrategy(0, 0, node_group="node")


def test_torch_device_type_is_none_without_an_accelerator(monkeypatch):
    monkeypatch.setenv("ACCELERATOR_TYPE", "NO_ACCEL")
    assert px.Worker.torch_device_type is None

    class Local(px.Worker):
        pass

    assert Local().torch_device_type is None
    assert "torch_device_type" in Local.px_base_attributes  # never a group method
    monkeypatch.setenv("ACCELERATOR_TYPE", "NV_GPU")
    assert px.Worker.torch_device_type == "cuda"
