"""What the sender and the transports' sender halves share: the record of one send and
the interface of a sender half.

A sender half belongs to one ``WeightSender`` (it keeps that sender's buffers, rings or
process groups between sends). For each send, ``place`` puts the bytes where the given
receivers will read them and returns the payload their receiver half gets; ``start``
runs once the receivers' apply calls are out (a broadcast needs them listening);
``finish`` runs before the acks are collected.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.weights.layout import Layout


@dataclass
class Delivery:
    """One version on its way: who gets it, through what, and what must stay alive."""

    version: int
    ranks: list[int]
    transport: str
    layout: Layout
    sources: list[torch.Tensor]
    t0: float
    timings: dict[str, float] = field(default_factory=dict)
    refs: dict[int, Any] = field(default_factory=dict)  # rank -> its apply call's ref
    routes: dict[int, str] = field(default_factory=dict)  # rank -> the transport it takes
    dead: dict[int, str] = field(default_factory=dict)  # ranks found dead before sending
    thread: threading.Thread | None = None
    thread_error: list[BaseException] = field(default_factory=list)
    keep: list[Any] = field(default_factory=list)  # alive until the receivers are done
    strict: bool = True
    ring_path: str | None = None  # the shared buffer this version was written to
    prepared: bool = False  # the bytes were placed by someone else (send_prepared)
    source: Any = None  # what the weights were taken from (re-read to restore a worker)


class SenderHalf(ABC):
    """A transport's sending side for one sender; ``owner`` is the ``WeightSender``
    (its public settings: ``group``, ``bucket_bytes``, ``timeout_s``, ``backend``,
    ``timers``)."""

    def __init__(self, owner: Any):
        self.owner = owner

    @abstractmethod
    def place(self, send: Delivery, ranks: list[int]) -> Any:
        """Put ``send``'s bytes where ``ranks`` will read them; the payload they get."""

    def start(self, send: Delivery, snapshot: bool) -> None:
        """Run once the receivers' apply calls are out (``snapshot``: the caller keeps
        changing its tensors, so copy them first)."""
        return None

    def finish(self, send: Delivery, deadline: float) -> None:
        """Run before the acks are collected (``deadline``: ``time.perf_counter()``)."""
        return None

    def close(self) -> None:
        """Release what the half keeps between sends."""
        return None
