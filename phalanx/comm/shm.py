"""Same-node shared memory for CPU tensors: files in ``/dev/shm`` mapped by both sides.

The sender copies the bytes in once; the receiver builds its tensors as views of the
mapping (no second copy). Messages to one peer go through a ``SegmentPool``: a few
segments that both sides keep mapped, so after the first use of a slot neither side
pays for new pages again. A slot's first byte says whether it is in use: the sender sets
it before writing a message in, the receiver clears it when the last tensor viewing that
message is freed, so a received tensor stays valid for as long as it lives. When every
slot is in use (the receiver keeps its tensors) and the pool is at its limits, a message
goes in a one-shot segment that the receiver owns. Either way the receiver unlinks the
name once it has mapped it, so nothing is left in ``/dev/shm`` once both sides let go.
``posix_fallocate`` reserves the space up front so a full ``/dev/shm`` is an ``OSError``
(and the caller falls back to a socket transport), never a ``SIGBUS`` while writing.

``share_tensors`` / ``ShmHandle`` are the public helper other layers use (e.g. weight
sync to several workers on one node: write once, every reader opens the same handle).
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phalanx.comm.buffers import Recycler, lease

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64
_HEADER = _ALIGN  # a pool slot's first byte: 1 while a message in it is alive
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


def _create(tag: str, size: int) -> str:
    """A new file of ``size`` bytes, its space reserved; tracked until a reader unlinks it."""
    path = _new_path(tag)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with _created_lock:
        _created.add(path)
        if len(_created) > 1024:  # names the readers already unlinked
            _created.intersection_update({p for p in _created if os.path.exists(p)})
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        unlink(path)
        raise
    os.close(fd)
    return path


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SegmentRef:
    """Where a message's bulk bytes are: a pool slot (``pooled``) or a one-shot segment."""

    path: str
    size: int  # bytes of the message
    capacity: int = 0  # bytes of the slot's file (pooled only)
    pooled: bool = False
    retired: tuple[str, ...] = ()  # slots the sender stopped using: the reader drops them


class _Slot:
    __slots__ = ("path", "capacity", "mm", "data")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.path = _create("pool", _HEADER + capacity)
        self.mm = _map(self.path, _HEADER + capacity)
        self.data = lease(self.mm, _HEADER, capacity)

    def free(self) -> bool:
        return self.mm[0] == 0


class SegmentPool(Recycler):
    """Reusable segments for the messages this process sends to one peer (sender side)."""

    def __init__(self, max_slots: int = 4, max_bytes: int = 1 << 30):
        super().__init__(max_slots, max_bytes)
        self._retired: list[str] = []

    def write(self, blobs: list[torch.Tensor]) -> tuple[SegmentRef, list[int]]:
        """Copy flat uint8 tensors into a free slot (or a one-shot segment); (ref, offsets)."""
        offsets, total = [], 0
        for b in blobs:
            offsets.append(total)
            total += aligned(b.numel())
        total = max(total, _ALIGN)
        slot = self._acquire(total)
        if slot is None:
            path, size, offsets = write_segment(blobs)
            return SegmentRef(path, size, retired=self._take_retired()), offsets
        slot.mm[0] = 1
        for b, off in zip(blobs, offsets):
            slot.data[off : off + b.numel()].copy_(b)
        ref = SegmentRef(slot.path, total, slot.capacity, True, self._take_retired())
        return ref, offsets

    def close(self) -> None:
        """Let go of every slot (the peer is gone or reconnected)."""
        for slot in self._items:
            unlink(slot.path)
        self._items.clear()
        self._retired.clear()

    def _make(self, nbytes: int) -> _Slot:
        return _Slot(nbytes)

    def _drop(self, slot: _Slot) -> None:
        unlink(slot.path)
        self._retired.append(slot.path)

    def _take_retired(self) -> tuple[str, ...]:
        retired, self._retired = tuple(self._retired), []
        return retired


def _release(mm: mmap.mmap) -> None:
    if not mm.closed:
        mm[0] = 0


class SegmentReader:
    """Maps the segments one peer sends through (receiver side), each pool slot once."""

    def __init__(self) -> None:
        self._maps: dict[str, mmap.mmap] = {}

    def open(self, ref: SegmentRef) -> torch.Tensor:
        """The message's bytes as a flat uint8 tensor viewing the shared memory."""
        for path in ref.retired:
            self._maps.pop(path, None)
        if not ref.pooled:
            return open_segment(ref.path, ref.size)
        mm = self._maps.get(ref.path)
        if mm is None:
            mm = self._maps[ref.path] = _map(ref.path, _HEADER + ref.capacity)
            unlink(ref.path)
        return lease(mm, _HEADER, ref.size, functools.partial(_release, mm))

    def clear(self) -> None:
        """Forget every mapping (a new incarnation of the peer)."""
        self._maps.clear()


def write_segment(blobs: list[torch.Tensor], tag: str = "msg") -> tuple[str, int, list[int]]:
    """Copy flat uint8 tensors into a new shared-memory file; returns (path, size, offsets)."""
    import torch

    offsets, total = [], 0
    for b in blobs:
        offsets.append(total)
        total += aligned(b.numel())
    total = max(total, _ALIGN)
    path = _create(tag, total)
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
