"""Layer 2, resources: the cluster (start or join Ray), placement strategies (phalanx's
and RLinf's) and the NeMo-RL virtual cluster (placement groups and bundles)."""

from __future__ import annotations

from phalanx.resources.cluster import Cluster, NodeInfo
from phalanx.resources.placement import (
    FlexiblePlacement,
    NodePlacement,
    PackedPlacement,
    Placement,
    WorkerSlot,
)
from phalanx.resources.strategies import (
    FlexiblePlacementStrategy,
    NodePlacementStrategy,
    PackedPlacementStrategy,
    PlacementError,
    PlacementIndexError,
    PlacementStrategy,
    RankPlacement,
)
from phalanx.resources.virtual_cluster import RayVirtualCluster

__all__ = [
    "Cluster",
    "FlexiblePlacement",
    "FlexiblePlacementStrategy",
    "NodeInfo",
    "NodePlacement",
    "NodePlacementStrategy",
    "PackedPlacement",
    "PackedPlacementStrategy",
    "Placement",
    "PlacementError",
    "PlacementIndexError",
    "PlacementStrategy",
    "RankPlacement",
    "RayVirtualCluster",
    "WorkerSlot",
]
