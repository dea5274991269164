"""Layer 2, resources: the cluster (start or join Ray, retried on a busy machine),
placement strategies (phalanx's and RLinf's) and the NeMo-RL virtual cluster."""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "Cluster": ".cluster",
        "NodeInfo": ".cluster",
        "FlexiblePlacement": ".placement",
        "NodePlacement": ".placement",
        "PackedPlacement": ".placement",
        "Placement": ".placement",
        "WorkerSlot": ".placement",
        "FlexiblePlacementStrategy": ".strategies",
        "NodePlacementStrategy": ".strategies",
        "PackedPlacementStrategy": ".strategies",
        "PlacementError": ".strategies",
        "PlacementIndexError": ".strategies",
        "PlacementStrategy": ".strategies",
        "RankPlacement": ".strategies",
        "RayVirtualCluster": ".virtual_cluster",
        "RayStartError": ".ray_start",
        "init_ray": ".ray_start",
        "start_ray": ".ray_start",
    },
)
