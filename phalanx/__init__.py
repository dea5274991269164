"""phalanx: a runtime for distributed reinforcement learning on Ray.

Public names are importable from here. Modules that need torch are imported on first
use, so a worker process that does not touch them starts quickly.
"""

from __future__ import annotations

from ._lazy import lazy_exports
from .address import WorkerAddress
from .builder import RayWorkerBuilder
from .cluster import Cluster, NodeInfo
from .errors import GroupTimeoutError, WorkerDiedError, WorkerError
from .futures import GroupHandle, MultiWorkerFuture
from .group import RayWorkerGroup, UnknownMethodError, WorkerGroup
from .placement import FlexiblePlacement, NodePlacement, PackedPlacement, Placement, WorkerSlot
from .sharding import NamedSharding
from .timing import reduce_durations
from .virtual_cluster import RayVirtualCluster
from .worker import Worker, WorkerInfo

__version__ = "0.1.0"

# name -> module, imported lazily (these pull in torch).
_LAZY = {
    "BatchedDataDict": ".data",
    "Channel": ".comm.channel",
    "CollectiveGroup": ".comm.collective",
    "CommError": ".comm.errors",
    "PeerDiedError": ".comm.errors",
    "Work": ".comm.work",
    "connect_channel": ".comm.channel",
    "create_channel": ".comm.channel",
    "AsyncSubmission": ".fault",
    "HangReport": ".hang",
    "HangTimeoutError": ".hang",
    "HealthEvent": ".fault",
    "RestartPolicy": ".fault",
    "Watchdog": ".hang",
    "WorkerHealth": ".fault",
    "RayModuleTransformSender": ".weights.sender",
    "SyncResult": ".weights.sender",
    "WeightMismatchError": ".weights.receiver",
    "WeightSender": ".weights.sender",
    "MetricsLogger": ".metrics",
    "Progress": ".progress",
    "DTensorPolicyWorker": ".llm.policy_worker",
    "Policy": ".llm.policy",
    "HFGenerationWorker": ".llm.generation",
    "GenerationInterface": ".llm.generation",
    "Refitter": ".llm.refit",
    "NLLLoss": ".llm.loss",
    "ClippedPGLossFn": ".llm.loss",
    "EnvContext": ".envs.config",
    "EnvRunner": ".envs.env_runner",
    "EnvRunnerGroup": ".envs.env_runner_group",
    "EnvRunnerGroupConfig": ".envs.config",
    "PPOConfig": ".algorithms.ppo",
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
    "GroupHandle",
    "GroupTimeoutError",
    "MultiWorkerFuture",
    "NamedSharding",
    "NodeInfo",
    "NodePlacement",
    "PackedPlacement",
    "Placement",
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
