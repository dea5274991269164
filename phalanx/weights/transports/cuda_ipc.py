"""CUDA IPC transport: receivers on the same GPU map the sender's packed buffer directly.

The sender packs the stream into one CUDA buffer and sends its IPC handle
(``comm.cuda_ipc``, which names the GPU by UUID since each worker sees its own
``CUDA_VISIBLE_DEVICES``); a receiver opens the handle and copies device to device. A
handle of a ``RefitBuffer`` (a policy's refit, sent with ``send_prepared``) is opened once
per buffer and kept (``refit_buffer.mapped_views``); others are opened per version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.comm.cuda_ipc import open_handle, share
from phalanx.weights.layout import Layout, pack_range
from phalanx.weights.transports.base import Delivery, SenderHalf
from phalanx.weights.transports.refit_buffer import mapped_views

ipc_handle = share  # the weights layer's name for it

__all__ = ["CudaIpcSender", "ipc_handle", "open_handle", "pack_to_cuda", "receive"]


def pack_to_cuda(layout: Layout, sources: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The whole stream in one uint8 CUDA buffer on ``device``."""
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    pack_range(flat, layout, sources, 0, layout.total_bytes)
    torch.cuda.synchronize(device)
    return flat


class CudaIpcSender(SenderHalf):
    """Packs each version into a fresh CUDA buffer kept alive until its receivers are done."""

    def place(self, send: Delivery, ranks: list[int]) -> Any:
        flat = pack_to_cuda(send.layout, send.sources, send.sources[0].device)
        send.keep.append(flat)
        return ipc_handle(flat)


def receive(
    worker: Any, layout: Layout, payload: dict[str, Any], skip: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    if skip:
        return {}, lambda: None
    handle = {**payload, "kind": "cuda_ipc", "layout": layout}
    return mapped_views(worker, handle), lambda: torch.cuda.synchronize()
