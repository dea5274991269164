"""Transports: how a packed weight stream reaches the receivers.

Each transport has a sender half (used by ``WeightSender``) and a receiver half that
turns a payload into ``{name: tensor}`` sources plus a release function. The receiver
half is picked here by the transport's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from phalanx.weights.layout import Layout

TRANSPORTS = ("auto", "object_store", "shm", "collective")


def receive(
    worker: Any, transport: str, layout: Layout, payload: Any, skip: bool = False
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Make a payload's tensors available on this worker (views where possible)."""
    if transport == "object_store":
        from phalanx.weights.transports.object_store import receive as fn
    elif transport == "shm":
        from phalanx.weights.transports.shm import receive as fn
    elif transport == "cuda_ipc":
        from phalanx.weights.transports.cuda_ipc import receive as fn
    elif transport == "collective":
        from phalanx.weights.transports.collective import receive as fn
    else:
        raise ValueError(f"unknown transport {transport!r}")
    return fn(worker, layout, payload, skip)
