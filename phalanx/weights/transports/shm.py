"""Same-node shared-memory transport for CPU weights.

The sender packs the stream into one file under ``/dev/shm`` (casting on the way) and
keeps it: the next send reuses it when it is big enough, so neither side pays page
faults again. Receivers map the file once, keep the mapping, and copy straight from it
into their parameters. Workers on other nodes get the object-store transport instead.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Callable
from typing import Any

import torch

from phalanx.weights.layout import Layout, pack_range, views

SHM_DIR = "/dev/shm"


class ShmSegment:
    """A named shared-memory file mapped into this process, as a flat uint8 tensor."""

    def __init__(self, size: int, name: str | None = None, create: bool = True):
        self.name = name or f"phalanx_w_{uuid.uuid4().hex[:16]}"
        self.size = max(int(size), 1)
        path = os.path.join(SHM_DIR, self.name)
        fd = os.open(path, (os.O_CREAT | os.O_EXCL | os.O_RDWR) if create else os.O_RDWR, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.size)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, self.size, flags=flags)
        finally:
            os.close(fd)
        self.owner = create
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    def unlink(self) -> None:
        """Remove the file (mappings stay valid until released)."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def pack_to_shm(
    layout: Layout, sources: list[torch.Tensor], segment: ShmSegment | None = None
) -> ShmSegment:
    """Pack the stream into ``segment`` (or a new one if it is missing or too small)."""
    if segment is None or segment.size < layout.total_bytes:
        if segment is not None:
            segment.unlink()
        segment = ShmSegment(layout.total_bytes)
    pack_range(segment.tensor[: layout.total_bytes], layout, sources, 0, layout.total_bytes)
    return segment


def open_views(
    name: str, layout: Layout, cache: dict[str, ShmSegment] | None = None
) -> dict[str, torch.Tensor]:
    """Views of every tensor of a packed segment (mapping reused through ``cache``)."""
    seg = cache.get(name) if cache is not None else None
    if seg is None or seg.size < layout.total_bytes:
        seg = _attach(name)
        if cache is not None:
            cache.clear()  # the sender moved to a new segment: drop the old mapping
            cache[name] = seg
    return views(seg.tensor, layout)


def _attach(name: str) -> ShmSegment:
    path = os.path.join(SHM_DIR, name)
    size = os.path.getsize(path)
    return ShmSegment(size, name=name, create=False)


def receive(
    host: Any, layout: Layout, payload: dict[str, Any], skip: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    if skip:
        return {}, lambda: None
    cache = host.__dict__.setdefault("_px_shm_cache", {})
    return open_views(payload["name"], layout, cache), lambda: None
