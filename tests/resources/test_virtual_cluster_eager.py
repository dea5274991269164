"""NeMo-RL's ``test_virtual_cluster::test_custom_port_range`` on a cluster without GPUs:
phalanx checks resources in ``RayVirtualCluster.__init__`` (a documented difference, see
docs/compat.md), so the GPU layout fails there, naming what is missing; the CPU layout
constructs and keeps the port range."""

from __future__ import annotations

import pytest

import phalanx as px

pytestmark = pytest.mark.timeout(120)


def test_gpu_bundles_on_a_cluster_without_gpus_fail_in_init(cluster):
    with pytest.raises(ValueError) as info:
        px.RayVirtualCluster(
            bundle_ct_per_node_list=[1], use_gpus=True, port_range_low=10000,
            port_range_high=11000,
        )  # fmt: skip
    assert str(info.value) == (
        "RayVirtualCluster[1]: not enough resources (GPU: needs 1, cluster has 0)"
    )


def test_the_same_layout_on_cpu_constructs_with_its_port_range(cluster):
    vc = px.RayVirtualCluster(
        bundle_ct_per_node_list=[1], use_gpus=False, port_range_low=10000,
        port_range_high=11000,
    )  # fmt: skip
    try:
        assert (vc.port_range_low, vc.port_range_high) == (10000, 11000)
        assert vc.world_size() == 1
    finally:
        vc.shutdown()
