"""Layer 3a, workers: the ``Worker`` base class, the Ray actor that hosts it, and the
builder that starts it with its rank environment."""

from __future__ import annotations

from phalanx.worker.builder import RayWorkerBuilder
from phalanx.worker.worker import Worker, WorkerInfo

__all__ = ["RayWorkerBuilder", "Worker", "WorkerInfo"]
