"""phalanx: a runtime for distributed reinforcement learning on Ray.

Public names are importable from here. Modules that need torch are imported on first
use, so a worker process that does not touch them starts quickly.
"""

from __future__ import annotations

from typing import Any

from phalanx._base.address import WorkerAddress
from phalanx._base.errors import GroupTimeoutError, WorkerDiedError, WorkerError
from phalanx._base.lazy import lazy_exports
from phalanx._base.timing import reduce_durations
from phalanx.worker.worker import Worker, WorkerInfo, register_group_factory

__version__ = "0.1.0"

# name -> module, imported on first use. Every worker process imports this package (its
# host lives in phalanx.worker), so only what a worker always needs is imported above:
# the group, placement and data layers (numpy, torch) load when first named.
_LAZY = {
    "GroupHandle": "phalanx.group.futures",
    "MultiWorkerFuture": "phalanx.group.futures",
    "RayWorkerGroup": "phalanx.group.group",
    "UnknownMethodError": "phalanx.group.group",
    "WorkerGroup": "phalanx.group.group",
    "NamedSharding": "phalanx.group.sharding",
    "Cluster": "phalanx.resources.cluster",
    "NodeInfo": "phalanx.resources.cluster",
    "FlexiblePlacement": "phalanx.resources.placement",
    "NodePlacement": "phalanx.resources.placement",
    "PackedPlacement": "phalanx.resources.placement",
    "Placement": "phalanx.resources.placement",
    "WorkerSlot": "phalanx.resources.placement",
    "FlexiblePlacementStrategy": "phalanx.resources.strategies",
    "NodePlacementStrategy": "phalanx.resources.strategies",
    "PackedPlacementStrategy": "phalanx.resources.strategies",
    "PlacementError": "phalanx.resources.strategies",
    "PlacementIndexError": "phalanx.resources.strategies",
    "PlacementStrategy": "phalanx.resources.strategies",
    "RankPlacement": "phalanx.resources.strategies",
    "RayVirtualCluster": "phalanx.resources.virtual_cluster",
    "RayWorkerBuilder": "phalanx.worker.builder",
    "BatchedDataDict": "phalanx.data",
    "Channel": "phalanx.comm.channel",
    "CollectiveGroup": "phalanx.comm.collective",
    "CommError": "phalanx.comm.errors",
    "PeerDiedError": "phalanx.comm.errors",
    "Work": "phalanx.comm.work",
    "connect_channel": "phalanx.comm.channel",
    "create_channel": "phalanx.comm.channel",
    "AsyncSubmission": "phalanx.group.requests",
    "HangReport": "phalanx.group.hang",
    "HangTimeoutError": "phalanx.group.hang",
    "HealthEvent": "phalanx.group.fault",
    "RestartPolicy": "phalanx.group.fault",
    "Watchdog": "phalanx.group.hang",
    "WorkerHealth": "phalanx.group.fault",
    "RayModuleTransformSender": "phalanx.weights.sender",
    "SyncResult": "phalanx.weights.sender",
    "WeightMismatchError": "phalanx.weights.receiver",
    "WeightSender": "phalanx.weights.sender",
    "MetricsLogger": "phalanx.observe.metrics",
    "Progress": "phalanx.observe.progress",
    "DTensorPolicyWorker": "phalanx.llm.policy_worker",
    "Policy": "phalanx.llm.policy",
    "HFGenerationWorker": "phalanx.llm.generation",
    "GenerationInterface": "phalanx.llm.generation",
    "Refitter": "phalanx.llm.refit",
    "NLLLoss": "phalanx.llm.loss",
    "ClippedPGLossFn": "phalanx.llm.loss",
    "EnvContext": "phalanx.envs.config",
    "EnvRunner": "phalanx.envs.env_runner",
    "EnvRunnerGroup": "phalanx.envs.env_runner_group",
    "EnvRunnerGroupConfig": "phalanx.envs.config",
    "PPOConfig": "phalanx.algorithms.ppo",
}


def _create_group(**kwargs: Any) -> Any:
    """``Worker.create_group``'s factory until the group layer is imported (which then
    registers ``WorkerGroup`` itself)."""
    import phalanx.group  # noqa: F401  (registers WorkerGroup)
    from phalanx.group.group import WorkerGroup

    return WorkerGroup(**kwargs)


register_group_factory(_create_group)

__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = [
    "MetricsLogger",
    "Progress",
    "EnvContext",
    "EnvRunner",
    "EnvRunnerGroup",
    "EnvRunnerGroupConfig",
    "PPOConfig",
    "ClippedPGLossFn",
    "DTensorPolicyWorker",
    "GenerationInterface",
    "HFGenerationWorker",
    "NLLLoss",
    "Policy",
    "Refitter",
    "Channel",
    "CollectiveGroup",
    "CommError",
    "PeerDiedError",
    "Work",
    "connect_channel",
    "create_channel",
    "AsyncSubmission",
    "HangReport",
    "HangTimeoutError",
    "HealthEvent",
    "RestartPolicy",
    "Watchdog",
    "WorkerHealth",
    "RayModuleTransformSender",
    "SyncResult",
    "WeightMismatchError",
    "WeightSender",
    "BatchedDataDict",
    "Cluster",
    "FlexiblePlacement",
    "FlexiblePlacementStrategy",
    "GroupHandle",
    "GroupTimeoutError",
    "MultiWorkerFuture",
    "NamedSharding",
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
    "RayWorkerBuilder",
    "RayWorkerGroup",
    "UnknownMethodError",
    "Worker",
    "WorkerAddress",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "WorkerInfo",
    "WorkerSlot",
    "reduce_durations",
]
