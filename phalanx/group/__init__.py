"""Layer 3b, groups: ``WorkerGroup`` (RLinf, NeMo-RL and RLlib faces over one call path),
handles and futures, named sharding, and fault tolerance (health, restarts, hang reports)."""

from __future__ import annotations

from phalanx.group.futures import GroupHandle, MultiWorkerFuture
from phalanx.group.group import RayWorkerGroup, UnknownMethodError, WorkerGroup
from phalanx.group.results import CallResult, RemoteCallResults, ResultOrError
from phalanx.group.sharding import NamedSharding
from phalanx.worker.worker import register_group_factory

# Worker.create_group builds its group through this factory (worker sits below group).
register_group_factory(WorkerGroup)

__all__ = [
    "CallResult",
    "GroupHandle",
    "MultiWorkerFuture",
    "NamedSharding",
    "RayWorkerGroup",
    "RemoteCallResults",
    "ResultOrError",
    "UnknownMethodError",
    "WorkerGroup",
]
