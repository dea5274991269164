"""Receive buffers that are reused once the tensors built on them are freed.

A large receive into fresh memory pays for new pages (a page fault per 4 KiB) on every
message; a socket or gloo transfer is then a good deal slower than into a preallocated
buffer. ``lease`` hands out a tensor over part of a long-lived buffer and calls back when
the last tensor viewing it (views and slices included) is gone, so the buffer can be
reused without the caller having to give anything back. ``BufferPool`` keeps a few such
buffers per peer; shared-memory segments use ``lease`` the same way (``shm.py``).
"""

from __future__ import annotations

import abc
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def lease(
    buf: Any, offset: int, nbytes: int, on_free: Callable[[], None] | None = None
) -> torch.Tensor:
    """A flat uint8 tensor over ``buf[offset:offset + nbytes]`` (any writable buffer).

    ``on_free`` runs once every tensor sharing its storage has been freed: torch keeps the
    numpy array under the storage alive exactly that long.
    """
    import numpy as np
    import torch

    arr = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=offset)
    if on_free is not None:
        weakref.finalize(arr, on_free).atexit = False
    return torch.from_numpy(arr)


class Recycler(abc.ABC):
    """Reusable items (buffers, segments) of varying capacity, bounded in count and bytes.

    Items have a ``capacity`` and a ``free()`` test; subclasses say how to make one
    (``_make``) and what to do with one they drop (``_drop``).
    """

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._items: list[Any] = []

    def _acquire(self, nbytes: int) -> Any | None:
        """The smallest free item that holds ``nbytes``, or a new one within the limits."""
        free = [i for i in self._items if i.free()]
        fits = [i for i in free if i.capacity >= nbytes]
        if fits:
            return min(fits, key=lambda i: i.capacity)
        for i in sorted(free, key=lambda i: i.capacity):  # free but too small: make room
            if self._room_for(nbytes):
                break
            self._items.remove(i)
            self._drop(i)
        if not self._room_for(nbytes):
            return None
        item = self._make(nbytes)
        self._items.append(item)
        return item

    def _room_for(self, nbytes: int) -> bool:
        used = sum(i.capacity for i in self._items)
        return len(self._items) < self.max_items and used + nbytes <= self.max_bytes

    @abc.abstractmethod
    def _make(self, nbytes: int) -> Any:
        """A new item of ``nbytes`` capacity."""

    def _drop(self, item: Any) -> None:  # noqa: B027 - a hook; the default needs nothing
        """Nothing to do by default: the item is freed with its last reference."""


class _Buffer:
    __slots__ = ("data", "capacity", "busy")

    def __init__(self, nbytes: int):
        import numpy as np

        self.data = np.empty(nbytes, dtype=np.uint8)
        self.capacity = nbytes
        self.busy = False

    def free(self) -> bool:
        return not self.busy

    def release(self) -> None:
        self.busy = False


class BufferPool(Recycler):
    """A few reusable receive buffers (for the messages of one peer)."""

    def __init__(self, max_buffers: int = 4, max_bytes: int = 1 << 30, min_bytes: int = 1 << 20):
        super().__init__(max_buffers, max_bytes)
        self.min_bytes = min_bytes
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``nbytes``: a free pooled buffer when one fits, else new memory."""
        import torch

        if nbytes < self.min_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            buf = self._acquire(nbytes)
            if buf is None:
                return torch.empty(nbytes, dtype=torch.uint8)
            buf.busy = True
        return lease(buf.data, 0, nbytes, buf.release)

    def _make(self, nbytes: int) -> _Buffer:
        return _Buffer(nbytes)
