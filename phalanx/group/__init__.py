"""Layer 3b, groups: ``WorkerGroup`` (RLinf, NeMo-RL and RLlib faces over one call path),
handles and futures, named sharding, and fault tolerance (health, restarts, hang reports)."""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "GroupHandle": ".futures",
        "MultiWorkerFuture": ".futures",
        "RayWorkerGroup": ".group",
        "UnknownMethodError": ".group",
        "WorkerGroup": ".group",
        "CallResult": ".results",
        "RemoteCallResults": ".results",
        "ResultOrError": ".results",
        "NamedSharding": ".sharding",
    },
)
