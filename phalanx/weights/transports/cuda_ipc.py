"""CUDA IPC transport: receivers on the same GPU map the sender's packed buffer directly.

The sender packs the stream into one CUDA buffer and sends its IPC handle; a receiver
finds its local index of the same physical GPU (by UUID, since each worker sees its own
``CUDA_VISIBLE_DEVICES``), opens the handle and copies device to device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.weights.layout import Layout, pack_range, views


def pack_to_cuda(layout: Layout, sources: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The whole stream in one uint8 CUDA buffer on ``device``."""
    flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    pack_range(flat, layout, sources, 0, layout.total_bytes)
    torch.cuda.synchronize(device)
    return flat


def ipc_handle(flat: torch.Tensor) -> dict[str, Any]:
    """A picklable handle of a CUDA tensor, plus the UUID of its GPU."""
    from torch.multiprocessing.reductions import reduce_tensor

    fn, args = reduce_tensor(flat)
    return {"fn": fn, "args": args, "uuid": str(torch.cuda.get_device_properties(flat.device).uuid)}


def open_handle(handle: dict[str, Any]) -> torch.Tensor:
    """The sender's tensor, mapped on this process's index of the same GPU."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == handle["uuid"]:
            args = list(handle["args"])
            args[6] = i  # storage_device: this process's index of that GPU
            return handle["fn"](*args)
    raise RuntimeError(
        f"cuda_ipc: GPU {handle['uuid']} is not visible to this worker; use the "
        "collective or object_store transport across GPUs"
    )


def receive(
    host: Any, layout: Layout, payload: dict[str, Any], skip: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    if skip:
        return {}, lambda: None
    flat = open_handle(payload)
    return views(flat, layout), lambda: torch.cuda.synchronize()
