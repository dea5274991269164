"""A generation rank as a refit receiver: the policy's weights, whole or from its IPC
handles or collective broadcast, loaded into the rank's weights module.

The receiving halves of ``RefitSource``'s methods, built on the weight-sync layer
(``phalanx.weights``): its layout, mapped buffers, collective receive and all-or-nothing
copy. ``GenerationWorker`` holds one ``RefitReceiver`` and its refit methods call it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch

PG_TIMEOUT_S = 300.0


class RefitReceiver:
    """One generation rank's refit methods and the refit group it joins.

    Each method loads a whole version into the worker's weights module (the module
    ``phalanx.weights.WeightSender`` refits too, any transport) and counts it in ``updates``.

    Args:
        worker: the generation worker (its weights module and receiver state).
        rank: the worker's rank in its group.
        device: the worker's device.
        on_applied: called after each version is loaded, or None.
    """

    def __init__(
        self,
        worker: Any,
        rank: int,
        device: torch.device,
        on_applied: Callable[[], Any] | None = None,
    ) -> None:
        self._worker = worker
        self.rank = rank
        self.device = device
        self._on_applied = on_applied
        self.updates = 0  # versions loaded through this receiver's methods
        self._store: Any = None
        self.model_update_group: Any = None  # the collective refit's process group

    def apply(self, layout: Any, tensors: dict[str, torch.Tensor]) -> bool:
        """Copy the version ``tensors`` (named as ``layout``'s specs) into the weights."""
        from phalanx.weights import apply_weights

        apply_weights(self._worker, layout, tensors)
        self.updates += 1
        if self._on_applied is not None:
            self._on_applied()
        return True

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, Any]) -> bool:
        """Load a full state dict (tensors or arrays, names as in the model) in place."""
        from phalanx.weights import gather, to_named_tensors

        named = to_named_tensors(state_dict)
        layout, sources = gather(named)
        return self.apply(layout, {s.name: t for s, t in zip(layout.specs, sources)})

    def device_id(self) -> str:
        """The key of this rank's handle: its GPU's UUID, or ``cpu:<host>``."""
        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(self.device).uuid)
        return f"cpu:{socket.gethostname()}"

    def update_weights_from_ipc_handles(self, handles: dict[str, Any]) -> bool:
        """Copy in the weights behind this device's handle (see the worker's method)."""
        from phalanx.weights import mapped_views

        if not isinstance(handles, dict) or not handles:
            raise ValueError("update_weights_from_ipc_handles: handles must be a non-empty dict")
        own = self.device_id()
        handle = handles.get(own)
        if handle is None:
            raise ValueError(
                f"update_weights_from_ipc_handles: no handle for this worker's device {own!r} "
                f"(have {sorted(handles)}); IPC works on the same node/GPU only"
            )
        ok = self.apply(handle["layout"], mapped_views(self._worker, handle))
        if handle["kind"] == "cuda_ipc":
            torch.cuda.synchronize()  # the copy is done: the sender may rewrite its buffer
        return ok

    def init_collective(self, ip: str, port: int, world_size: int, rank_offset: int) -> bool:
        """Join the refit group as rank ``rank_offset + rank``."""
        from phalanx.comm.process_group import join_store
        from phalanx.weights import new_process_group

        store = join_store(ip, port, PG_TIMEOUT_S, world_size)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self._store = store
        self.model_update_group = new_process_group(
            store, "refit", rank_offset + self.rank, world_size, backend, PG_TIMEOUT_S
        )
        return True

    def update_weights_from_collective(self, info: dict[str, Any]) -> bool:
        """Receive the policy's broadcast described by ``info`` and copy it in."""
        from phalanx.weights import receive_stream, views

        if self.model_update_group is None:
            raise RuntimeError("update_weights_from_collective: call init_collective first")
        layout = info["layout"]
        flat = receive_stream(self.model_update_group, layout, info["bucket_bytes"], self.device)
        return self.apply(layout, views(flat, layout))


__all__ = ["RefitReceiver"]
