"""The lock weights are applied under: the worker layer's call lock, under its old names.

``ReadWriteLock`` and ``call_lock`` live in ``phalanx.worker.call_lock`` (the host takes
the read side on every call); ``model_lock(worker)`` is the same as ``call_lock(worker)``.
"""

from __future__ import annotations

from phalanx.worker.call_lock import ReadWriteLock, call_lock

model_lock = call_lock

__all__ = ["ReadWriteLock", "call_lock", "model_lock"]
