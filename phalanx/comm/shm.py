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
``posix_fallocate`` reserves the space up front so a full ``/dev/shm`` is a
``ShmFullError`` (an ``OSError`` naming ``/dev/shm``, the size needed and the space free;
the caller falls back to a socket transport), never a ``SIGBUS`` while writing.

``share_tensors`` / ``ShmHandle`` and ``Segment`` (a named, mapped file kept across
sends, e.g. the weight sender's buffers) are the helpers other layers use; nothing
outside this module opens files under ``/dev/shm``.

Leaks: every name this module makes carries its creator's identity, ``px_<tag>_<pid>-
<start>_<n>`` (``<start>`` is the process's start time, so a reused pid does not look
alive). ``reap_orphans()`` unlinks the segments whose creator is gone; every worker host
runs it when it starts and the weight sender when it starts and closes, so a process
killed mid-send (which cannot clean up after itself) leaves nothing behind for longer
than until the next phalanx process starts on that node. Processes that exit normally
unlink what they still own at exit.
"""

from __future__ import annotations

import atexit
import errno
import functools
import itertools
import mmap
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phalanx.comm.buffers import Recycler, lease
from phalanx.comm.errors import ShmFullError

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
_ALIGN = 64
_HEADER = _ALIGN  # a pool slot's first byte: 1 while a message in it is alive
_counter = itertools.count()
_created: set[str] = set()
_created_lock = threading.Lock()


def shm_free_bytes() -> int | None:
    """Bytes free in ``/dev/shm`` for this process (None where it cannot be read)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: count fields after its closing ")".
    return stat[stat.rfind(b")") + 2 :].split()[19].decode()


_OWNER: str | None = None
_NAME = re.compile(r"^px_[A-Za-z0-9]+_(\d+)-(\d+)_")


def owner_token() -> str:
    """This process's identity in segment names: ``<pid>-<start time>``."""
    global _OWNER
    pid = os.getpid()
    if _OWNER is None or not _OWNER.startswith(f"{pid}-"):  # set again after a fork
        _OWNER = f"{pid}-{_start_time(pid) or 0}"
    return _OWNER


def _new_path(tag: str) -> str:
    return os.path.join(SHM_DIR, f"px_{tag}_{owner_token()}_{next(_counter)}")


def owner_pid(name: str) -> int | None:
    """The pid of the process that made the phalanx segment ``name`` (None if not one)."""
    m = _NAME.match(os.path.basename(name))
    return None if m is None else int(m.group(1))


def owner_alive(name: str) -> bool:
    """False when ``name`` is a phalanx segment whose creating process has ended."""
    m = _NAME.match(os.path.basename(name))
    if m is None:
        return True  # not ours to judge
    return _start_time(int(m.group(1))) == m.group(2)


def reap_orphans() -> list[str]:
    """Unlink the segments on this node whose creator died; returns their paths."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    reaped = []
    for n in names:
        if n.startswith("px_") and not owner_alive(n):
            path = os.path.join(SHM_DIR, n)
            unlink(path)
            reaped.append(path)
    return reaped


def segment_path(name: str) -> str:
    """The path of segment ``name`` (a bare name, or a path that must lie in ``/dev/shm``)."""
    path = name if os.path.isabs(name) else os.path.join(SHM_DIR, name)
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path):
        raise ValueError(f"not a shared-memory segment name: {name!r}")
    return path


def _create(tag: str, size: int, path: str | None = None) -> str:
    """A new file of ``size`` bytes, its space reserved; tracked until a reader unlinks it."""
    path = path or _new_path(tag)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with _created_lock:
        _created.add(path)
        if len(_created) > 1024:  # names the readers already unlinked
            _created.intersection_update({p for p in _created if os.path.exists(p)})
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        unlink(path)
        if e.errno == errno.ENOSPC:
            raise ShmFullError(path, size, shm_free_bytes()) from None
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


def link_segment(path: str, count: int) -> list[str]:
    """``count`` extra names (hard links) of one segment, one per reader: each reader unlinks
    its own name when it maps it, so the memory is freed once every reader let go. On a
    failure the links made so far are removed and the error is raised."""
    names: list[str] = []
    try:
        for j in range(count):
            name = f"{path}.{j}"
            os.link(path, name)
            names.append(name)
    except OSError:
        for name in names:
            unlink(name)
        raise
    return names


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


atexit.register(cleanup_created)


class Segment:
    """A named shared-memory file of ``size`` bytes, mapped here as a flat uint8 tensor.

    ``Segment.create(size, tag)`` makes a new one (its space reserved, so a full
    ``/dev/shm`` is an ``OSError`` here and not a ``SIGBUS`` later); ``Segment.attach(path)``
    maps one another process made. ``populate`` maps the pages up front (a reader about
    to read all of it saves a page fault per 4 KiB); ``writable=False`` maps read-only.
    """

    def __init__(self, path: str, size: int, mm: mmap.mmap, owner: bool):
        import torch

        self.path, self.size, self.owner = path, size, owner
        self._mm = mm
        self.tensor = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @classmethod
    def create(cls, size: int, tag: str = "seg", name: str | None = None) -> Segment:
        """A new segment; named after its owner (reapable) unless ``name`` is given."""
        size = max(int(size), 1)
        path = _create(tag, size, None if name is None else segment_path(name))
        return cls(path, size, _map(path, size), owner=True)

    @classmethod
    def attach(cls, name: str, populate: bool = False, writable: bool = True) -> Segment:
        """Map the existing segment ``name`` (a bare name or a path in ``/dev/shm``)."""
        path = segment_path(name)
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=flags, prot=prot)
        finally:
            os.close(fd)
        return cls(path, size, mm, owner=False)

    def unlink(self) -> None:
        """Remove the name (mappings, here and in readers, stay valid while they live)."""
        unlink(self.path)


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
