"""Layer 2, resources: the cluster (start or join Ray), placement strategies and the
NeMo-RL virtual cluster (placement groups and bundles)."""

from __future__ import annotations

from phalanx.resources.cluster import Cluster, NodeInfo
from phalanx.resources.placement import (
    FlexiblePlacement,
    NodePlacement,
    PackedPlacement,
    Placement,
    WorkerSlot,
)
from phalanx.resources.virtual_cluster import RayVirtualCluster

__all__ = [
    "Cluster",
    "FlexiblePlacement",
    "NodeInfo",
    "NodePlacement",
    "PackedPlacement",
    "Placement",
    "RayVirtualCluster",
    "WorkerSlot",
]
