"""Layer 3a, workers: the ``Worker`` base class, the Ray actor that hosts it, and the
builder that starts it with its rank environment."""

from __future__ import annotations

from phalanx._base.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "RayWorkerBuilder": ".builder",
        "Worker": ".worker",
        "WorkerInfo": ".worker",
    },
)
