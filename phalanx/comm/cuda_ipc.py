"""The one place phalanx makes and opens CUDA IPC handles (same-GPU tensor sharing).

A handle is picklable and names the physical GPU by UUID, because each worker sees its
own ``CUDA_VISIBLE_DEVICES`` and so its own index for the same device. ``share`` hands
out a handle to the caller's tensor (the caller keeps it alive until every reader is
done); ``share_copy`` hands out a private copy the reader owns.
"""

from __future__ import annotations

import os
from typing import Any

from phalanx.comm.errors import PeerDiedError


def gpu_uuid(device: Any) -> str:
    """The UUID of the physical GPU behind ``device``."""
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def share(t: Any) -> dict[str, Any]:
    """A picklable handle to CUDA tensor ``t`` and the UUID of its GPU."""
    from torch.multiprocessing.reductions import reduce_tensor

    fn, args = reduce_tensor(t)
    return {"fn": fn, "args": args, "uuid": gpu_uuid(t.device), "pid": os.getpid()}


def share_copy(t: Any) -> dict[str, Any]:
    """A handle to a private copy of ``t`` (the receiver owns it once opened)."""
    return share(t.clone())


def _sender_gone(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by another user
        return False
    return False


def open_handle(handle: dict[str, Any]) -> Any:
    """The shared tensor, mapped on this process's index of the same GPU.

    A handle whose sending process has exited cannot be opened (CUDA frees the memory with
    its owner): that raises ``PeerDiedError`` naming the process, not CUDA's own error.
    """
    import torch

    pid = handle.get("pid")
    gone = PeerDiedError(
        f"pid {pid}", f"cuda_ipc: the process {pid} that shared this tensor is gone"
    )
    if _sender_gone(pid):
        raise gone
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == handle["uuid"]:
            args = list(handle["args"])
            args[6] = i  # storage_device: this process's index of that GPU
            try:
                return handle["fn"](*args)
            except RuntimeError as e:
                if _sender_gone(pid):
                    raise gone from e
                raise
    raise RuntimeError(
        f"cuda_ipc: GPU {handle['uuid']} is not visible to this process; use a transport "
        "that crosses GPUs (collective or object store)"
    )
