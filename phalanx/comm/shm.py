"""Same-node shared memory for CPU tensors: one file in ``/dev/shm`` per message.

The sender copies the bytes in once; the receiver maps the file and builds its tensors
as views of the mapping (no second copy), then unlinks the name, so the memory is freed
when the last tensor viewing it is. ``posix_fallocate`` reserves the space up front so a
full ``/dev/shm`` is an ``OSError`` (and the caller falls back to a socket transport),
never a ``SIGBUS`` while writing.

``share_tensors`` / ``ShmHandle`` are the public helper other layers use (e.g. weight
sync to several workers on one node: write once, every reader opens the same handle).
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64
_counter = itertools.count()
_created: set[str] = set()
_created_lock = threading.Lock()


def shm_supported() -> bool:
    """True where a tmpfs ``/dev/shm`` exists (Linux)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _new_path(tag: str) -> str:
    return os.path.join(SHM_DIR, f"px_{tag}_{os.getpid()}_{next(_counter)}")


def write_segment(blobs: list[torch.Tensor], tag: str = "msg") -> tuple[str, int, list[int]]:
    """Copy flat uint8 tensors into a new shared-memory file; returns (path, size, offsets)."""
    import torch

    offsets, total = [], 0
    for b in blobs:
        offsets.append(total)
        total += aligned(b.numel())
    total = max(total, _ALIGN)
    path = _new_path(tag)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with _created_lock:
        _created.add(path)
        if len(_created) > 1024:  # names the readers already unlinked
            _created.intersection_update({p for p in _created if os.path.exists(p)})
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    seg = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    for b, off in zip(blobs, offsets):
        seg[off : off + b.numel()].copy_(b)
    del seg
    return path, total, offsets


def open_segment(path: str, size: int, keep: bool = False) -> torch.Tensor:
    """Map a segment as a flat uint8 tensor; unlinks its name unless ``keep``."""
    import torch

    seg = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    if not keep:
        unlink(path)
    return seg


def unlink(path: str) -> None:
    """Remove a segment's name (the memory lives on while mapped)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with _created_lock:
        _created.discard(path)


def forget(path: str) -> None:
    """Stop tracking a segment this process created (its reader took ownership)."""
    with _created_lock:
        _created.discard(path)


def cleanup_created() -> None:
    """Unlink every segment this process created and no reader took over (exit, peer death)."""
    with _created_lock:
        paths = list(_created)
    for p in paths:
        unlink(p)


def view_as(
    seg: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` viewing ``seg`` at ``offset`` (no copy)."""
    import torch

    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return seg[offset : offset + nbytes].view(dtype).view(shape)


@dataclass(frozen=True)
class ShmHandle:
    """A picklable reference to tensors in one shared-memory file of this node."""

    path: str
    size: int
    specs: tuple[tuple[int, str, tuple[int, ...]], ...]  # (offset, dtype name, shape)

    def open(self, keep: bool = True) -> list[torch.Tensor]:
        """The tensors, as zero-copy views of the mapping (``keep=False`` unlinks the name)."""
        import torch

        seg = open_segment(self.path, self.size, keep=keep)
        return [view_as(seg, off, getattr(torch, dt), shape) for off, dt, shape in self.specs]

    def unlink(self) -> None:
        """Remove the name once every reader has opened it."""
        unlink(self.path)


def share_tensors(tensors: list[torch.Tensor]) -> ShmHandle:
    """Copy CPU tensors into one shared-memory file once; readers on this node ``open()`` it."""
    import torch

    if not isinstance(tensors, (list, tuple)) or not all(
        isinstance(t, torch.Tensor) for t in tensors
    ):
        raise TypeError("tensors must be a list of torch.Tensor")
    flat = []
    for i, t in enumerate(tensors):
        if t.device.type != "cpu":
            raise ValueError(f"tensors[{i}] is on {t.device}; shared memory holds CPU tensors")
        flat.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
    path, size, offsets = write_segment(flat, tag="share")
    specs = tuple(
        (off, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for off, t in zip(offsets, tensors)
    )
    return ShmHandle(path, size, specs)
