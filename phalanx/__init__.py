"""phalanx: a runtime for distributed reinforcement learning on Ray.

Public names are importable from here. Modules that need torch are imported on first
use, so a worker process that does not touch them starts quickly.
"""

from __future__ import annotations

from phalanx._base.address import WorkerAddress
from phalanx._base.errors import GroupTimeoutError, WorkerDiedError, WorkerError
from phalanx._base.lazy import lazy_exports
from phalanx._base.timing import reduce_durations
from phalanx.group.futures import GroupHandle, MultiWorkerFuture
from phalanx.group.group import RayWorkerGroup, UnknownMethodError, WorkerGroup
from phalanx.group.sharding import NamedSharding
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
from phalanx.worker.builder import RayWorkerBuilder
from phalanx.worker.worker import Worker, WorkerInfo

__version__ = "0.1.0"

# name -> module, imported lazily (these pull in torch).
_LAZY = {
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
