"""phalanx: a runtime for distributed reinforcement learning on Ray.

Public names are importable from here, each imported on first use (``_base/lazy.py``), so
a worker process that does not touch torch-heavy modules starts quickly, several threads
may import public names at once, and ``import phalanx`` loads neither Ray, torch nor
gymnasium (so the command line's Ctrl-C handling is in place before anything slow is
imported).
"""

from __future__ import annotations

from typing import Any

from phalanx._base.lazy import lazy_exports
from phalanx.worker.group_factory import register_group_factory

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "WorkerAddress": "phalanx._base.address",
        "GroupTimeoutError": "phalanx._base.errors",
        "WorkerDiedError": "phalanx._base.errors",
        "WorkerError": "phalanx._base.errors",
        "reduce_durations": "phalanx._base.timing",
        "Worker": "phalanx.worker.worker",
        "WorkerInfo": "phalanx.worker.worker",
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
        "BatchedDataDict": "phalanx.data.batched_data_dict",
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
        "PPOConfig": "phalanx.algorithms.ppo_config",
    },
)


def _create_group(**kwargs: Any) -> Any:
    """``Worker.create_group``'s factory: a ``WorkerGroup`` (the group layer sits above the
    worker layer, so the worker layer is told how to build one)."""
    from phalanx.group.group import WorkerGroup

    return WorkerGroup(**kwargs)


register_group_factory(_create_group)
