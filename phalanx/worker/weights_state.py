"""What a worker knows about the weights it received (worker layer; no torch).

``WeightsReceiverMixin`` is part of every ``px.Worker``: the version applied last, a torn
marker, the module that receives, and ``read_only_weights``, a class attribute a receiver
sets when it only runs inference on its weights (env runners, generation workers). Such a
receiver on the sender's node does not keep a copy of its own: its parameters become
views of the sender's shared-memory buffers (see ``phalanx/weights/transports/shm.py``),
so it must not write into them nor keep references to them across method calls.

``receiver_state(worker)`` is how the weights layer reads and updates this, for any
hosted object (a ``Worker`` subclass or not).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

_ATTR = "_px_receiver_state"
_lock = threading.Lock()


@dataclass
class ReceiverState:
    """Per-worker receiver bookkeeping; ``scratch`` holds the transports' caches."""

    owner: Any
    torn: int = 0  # a version whose in-place transfer broke midway (0: none)
    missing: tuple[str, ...] = ()  # names the last (partial) version did not carry
    view: str | None = None  # the shared buffer the parameters view (read-only receivers)
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def version(self) -> int:
        # Kept as an attribute of the worker: env runners restore it from checkpoints.
        return int(getattr(self.owner, "_px_weights_version", 0))

    @version.setter
    def version(self, value: int) -> None:
        self.owner._px_weights_version = int(value)

    @property
    def read_only(self) -> bool:
        return bool(getattr(type(self.owner), "read_only_weights", False))


def receiver_state(worker: Any) -> ReceiverState:
    """The receiver bookkeeping of ``worker`` (created on first use)."""
    state = worker.__dict__.get(_ATTR)
    if state is None:
        with _lock:
            state = worker.__dict__.setdefault(_ATTR, ReceiverState(worker))
    return state


class WeightsReceiverMixin:
    """Receiver side of weight sync, part of every ``px.Worker``."""

    _px_weights_version: int = 0
    read_only_weights: bool = False
    """True: on the sender's node, parameters become views of the sender's shared buffers
    (one copy per send for all such receivers). For inference-only workers."""

    @property
    def weights_version(self) -> int:
        """The version of the weights applied last (0: none received yet)."""
        return receiver_state(self).version

    @property
    def weights_torn(self) -> int:
        """A version whose in-place (collective) transfer broke midway, leaving the model
        a mix of two versions until a whole version is applied again; 0 when consistent."""
        return receiver_state(self).torn

    @property
    def weights_missing(self) -> tuple[str, ...]:
        """Names the last applied version did not carry (a ``strict=False`` send)."""
        return receiver_state(self).missing

    def weights_module(self) -> Any:
        """The ``torch.nn.Module`` that receives weights; ``self.model`` unless overridden.

        Returns:
            The module.

        Raises:
            AttributeError: the worker has no ``model``.
        """
        model = getattr(self, "model", None)
        if model is None:
            raise AttributeError(
                f"{type(self).__name__} has no model to receive weights: set self.model "
                "or override weights_module()"
            )
        return model
