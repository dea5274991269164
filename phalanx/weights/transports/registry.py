"""The table of transports: each name maps to its sender half and its receiver half.

One place registers them (``TRANSPORTS``); the sender makes one sender half per
transport (``sender_halves``) and routes each receiver to a name; a receiver finds the
half that reads a payload by the same name (``receive``). ``WeightSender``'s
``transport=`` is ``"auto"`` (a routing rule over these) or one of ``CHOICES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.weights.layout import Layout
from phalanx.weights.transports import collective, cuda_ipc, object_store, shm
from phalanx.weights.transports.base import SenderHalf

Receive = Callable[[Any, Layout, Any, bool], tuple[dict[str, torch.Tensor], Callable[[], None]]]


@dataclass(frozen=True)
class Transport:
    """A transport's two halves: ``sender(owner)`` makes the sending side for one
    ``WeightSender``; ``receive(worker, layout, payload, skip)`` makes a payload's tensors
    available on a worker (views where possible) plus a release function."""

    sender: Callable[[Any], SenderHalf]
    receive: Receive


TRANSPORTS: dict[str, Transport] = {
    "object_store": Transport(object_store.ObjectStoreSender, object_store.receive),
    "shm": Transport(shm.ShmSender, shm.receive),
    "cuda_ipc": Transport(cuda_ipc.CudaIpcSender, cuda_ipc.receive),
    "collective": Transport(collective.CollectiveSender, collective.receive),
}
# What WeightSender(transport=...) accepts: "shm" there routes CUDA weights by CUDA IPC.
CHOICES = ("auto", "object_store", "shm", "collective")


def sender_halves(owner: Any) -> dict[str, SenderHalf]:
    """One sender half of every transport, for the sender ``owner``."""
    return {name: t.sender(owner) for name, t in TRANSPORTS.items()}


def receive(
    worker: Any, transport: str, layout: Layout, payload: Any, skip: bool = False
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """Make a payload's tensors available on this worker through ``transport``'s half."""
    entry = TRANSPORTS.get(transport)
    if entry is None:
        raise ValueError(f"unknown transport {transport!r}; known: {sorted(TRANSPORTS)}")
    return entry.receive(worker, layout, payload, skip)
