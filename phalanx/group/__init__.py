"""Layer 3b, groups: ``WorkerGroup`` (RLinf, NeMo-RL and RLlib faces over one call path),
handles and futures, named sharding, and fault tolerance (health, restarts, hang reports)."""

from __future__ import annotations

from phalanx.group.futures import GroupHandle, MultiWorkerFuture
from phalanx.group.group import RayWorkerGroup, UnknownMethodError, WorkerGroup
from phalanx.group.sharding import NamedSharding

__all__ = [
    "GroupHandle",
    "MultiWorkerFuture",
    "NamedSharding",
    "RayWorkerGroup",
    "UnknownMethodError",
    "WorkerGroup",
]
