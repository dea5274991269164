"""How ``Worker.create_group`` builds a group: a factory that the group layer registers.

The worker layer never imports the group layer, which sits above it, so the top package
registers the factory when it is imported. This module imports nothing else, so that
``import phalanx`` stays cheap (Ray, torch and gymnasium come with the first name used).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_group_factory: Callable[..., Any] | None = None


def register_group_factory(factory: Callable[..., Any]) -> None:
    """Set how ``Worker.create_group`` builds a group: ``factory(remote_worker_builder=...)``.

    The group layer calls this when it is imported, so the worker layer need not import it.

    Args:
        factory: called with ``remote_worker_builder=`` (a ``RayWorkerBuilder``); returns
            the unlaunched group.

    Raises:
        TypeError: ``factory`` is not callable.
    """
    global _group_factory
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    _group_factory = factory


def registered_group_factory() -> Callable[..., Any] | None:
    """The factory last given to :func:`register_group_factory`, or ``None``."""
    return _group_factory
