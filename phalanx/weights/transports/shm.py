"""Same-node shared-memory transport for CPU weights, N-buffered by version.

The sender packs the stream (casting on the way) into one of a few shared buffers
(``comm.shm.Segment``) that it keeps from send to send, so after the first sends neither
side pays page faults again. Writers in other processes of the node (a trainer's ranks,
each writing its own rows) may fill a buffer instead: ``WeightSender.reserve_shared_buffer``
hands one out and ``send_prepared`` commits it as the next version, under the same rules. Receivers map each buffer once and keep the mapping; then:

- a receiver that trains (the default) copies from the buffer into its parameters;
- a ``read_only_weights`` receiver points its parameters at the buffer (route
  ``"shm_view"``): one copy per send in all, however many such receivers there are.

Because view receivers keep reading the buffer of the version they applied, a buffer is
rewritten only when no receiver holds it (``ShmRing.acquire``). A receiver that did not
answer (dead, or still busy past the deadline) may still read what it was given, so that
buffer is *retired*: its name is unlinked and the sender never writes it again; the
memory goes away when the last mapping does. Workers on other nodes get the object-store
transport instead.
"""

from __future__ import annotations

import errno
import shutil
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.comm.shm import SHM_DIR, Segment, segment_path
from phalanx.weights.layout import Layout, pack_range, views
from phalanx.weights.transports.base import Delivery, SenderHalf
from phalanx.worker.weights_state import receiver_state

_CACHE = "shm_maps"


@dataclass
class _Buffer:
    segment: Segment
    version: int = 0
    holders: set[int] = field(default_factory=set)  # ranks whose parameters view it
    reserved: bool = False  # handed to an outside writer, not yet committed to a version


def is_full(error: BaseException) -> bool:
    """True when ``error`` says ``/dev/shm`` has no room (``ENOSPC``)."""
    return isinstance(error, OSError) and error.errno == errno.ENOSPC


def _full(nbytes: int, why: str) -> OSError:
    free = shutil.disk_usage(SHM_DIR).free
    return OSError(
        errno.ENOSPC,
        f"{SHM_DIR} has no room for a weights buffer of {nbytes} bytes ({nbytes / 2**20:.1f} "
        f"MiB; {why}, {free} bytes free there): give the machine (or container) a larger "
        f"{SHM_DIR}, or send with transport='auto' or 'object_store'",
    )


class ShmRing:
    """The sender's shared buffers (at most ``max_buffers`` kept; more are retired).

    The sender fills a buffer itself (``write``), or hands one to writers in other
    processes on its node (``reserve``, then ``commit`` once they wrote it: e.g. the
    trainer's ranks, each writing its own rows). Either way a buffer is rewritten only
    when no receiver holds it.
    """

    def __init__(self, max_buffers: int = 3, max_bytes: int | None = None):
        self.max_buffers = max_buffers
        self.max_bytes = max_bytes  # the most bytes of /dev/shm its buffers may take
        self._bufs: list[_Buffer] = []
        self._retired: list[str] = []

    @property
    def paths(self) -> list[str]:
        return [b.segment.path for b in self._bufs]

    def acquire(self, nbytes: int, keep_newest: bool = False) -> _Buffer:
        """A buffer of at least ``nbytes`` that no receiver holds (the oldest such one).

        ``keep_newest``: never the buffer of the newest version (kept to restore
        restarted receivers from while the next version is being written).
        """
        newest = max(self._bufs, key=lambda b: b.version) if self._bufs else None
        free = [
            b
            for b in self._bufs
            if not b.holders and not b.reserved and not (keep_newest and b is newest)
        ]
        fits = [b for b in free if b.segment.size >= nbytes]
        if fits:
            return min(fits, key=lambda b: b.version)
        for b in free:  # too small: make room
            self._retire(b)
        while len(self._bufs) >= self.max_buffers:  # all held: retire the oldest
            spare = [b for b in self._bufs if not b.reserved] or self._bufs
            self._retire(min(spare, key=lambda b: b.version))
        held = sum(b.segment.size for b in self._bufs)
        if self.max_bytes is not None and held + nbytes > self.max_bytes:
            raise _full(nbytes, f"the sender may use {self.max_bytes} bytes, {held} in use")
        try:
            buf = _Buffer(Segment.create(nbytes, tag="w"))
        except OSError as e:
            if not is_full(e):
                raise
            raise _full(nbytes, "the allocation failed") from e
        self._bufs.append(buf)
        return buf

    def reserve(self, nbytes: int) -> str:
        """The path of a buffer for writers in other processes (see ``commit``).

        One reservation at a time: a new one releases an earlier one never committed.
        """
        for b in self._bufs:
            b.reserved = False
        buf = self.acquire(nbytes, keep_newest=True)
        buf.reserved = True
        return buf.segment.path

    def commit(self, path: str, version: int) -> Segment | None:
        """Mark the reserved buffer ``path`` as holding ``version``; its segment, or None
        when ``path`` is not this ring's reserved buffer."""
        path = segment_path(path)
        for b in self._bufs:
            if b.reserved and b.segment.path == path:
                b.reserved, b.version = False, version
                return b.segment
        return None

    def owns(self, path: str) -> bool:
        """True while ``path`` is one of the ring's buffers (not retired)."""
        return segment_path(path) in self.paths

    def write(self, layout: Layout, sources: list[torch.Tensor], version: int) -> dict[str, Any]:
        """Pack the stream into a free buffer; the payload receivers get."""
        buf = self.acquire(layout.total_bytes)
        pack_range(buf.segment.tensor[: layout.total_bytes], layout, sources, 0, layout.total_bytes)
        buf.version = version
        return {"path": buf.segment.path, "ring": True, "retired": self.take_retired()}

    def settle(self, path: str, holds: dict[int, str | None], unanswered: Iterable[int]) -> None:
        """Record what each answering rank holds now; retire ``path`` if some did not answer."""
        path = segment_path(path)
        for b in self._bufs:
            b.holders.difference_update(holds)
            b.holders.update(r for r, p in holds.items() if p and segment_path(p) == b.segment.path)
        if list(unanswered):
            for b in self._bufs:
                if b.segment.path == path:
                    self._retire(b)

    def forget(self, ranks: Iterable[int]) -> None:
        """``ranks`` hold nothing any more (restarted: a new process)."""
        ranks = set(ranks)
        for b in self._bufs:
            b.holders.difference_update(ranks)

    def take_retired(self) -> list[str]:
        retired, self._retired = self._retired, []
        return retired

    def close(self) -> None:
        for b in list(self._bufs):
            self._retire(b)
        self._retired.clear()

    def _retire(self, buf: _Buffer) -> None:
        buf.segment.unlink()
        self._bufs.remove(buf)
        self._retired.append(buf.segment.path)


class ShmSender(ShmRing, SenderHalf):
    """The shm transport's sender half: the sender's ring of shared buffers."""

    def __init__(self, owner: Any):
        SenderHalf.__init__(self, owner)
        ShmRing.__init__(self, max_bytes=owner.shm_max_bytes)

    def place(self, send: Delivery, ranks: list[int]) -> dict[str, Any]:
        payload = self.write(send.layout, send.sources, send.version)
        send.ring_path = payload["path"]
        return payload


def ShmSegment(size: int, name: str | None = None, create: bool = True) -> Segment:  # noqa: N802
    """Old name, kept for callers of the previous API: a ``comm.shm.Segment`` of ``size``
    bytes, created (named ``name`` if given) or, with ``create=False``, attached."""
    if create:
        return Segment.create(size, tag="w", name=name)
    if name is None:
        raise ValueError("ShmSegment(create=False) needs the name of the segment to attach")
    return Segment.attach(name)


def pack_to_shm(layout: Layout, sources: list[torch.Tensor], segment: Segment | None) -> Segment:
    """Pack the stream into ``segment`` (or a new one if it is missing or too small)."""
    if segment is None or segment.size < layout.total_bytes:
        if segment is not None:
            segment.unlink()
        segment = Segment.create(layout.total_bytes, tag="w")
    pack_range(segment.tensor[: layout.total_bytes], layout, sources, 0, layout.total_bytes)
    return segment


# -- receiver half -------------------------------------------------------------------------


def _mapping(worker: Any, path: str) -> Segment:
    path = segment_path(path)
    cache: dict[str, Segment] = receiver_state(worker).scratch.setdefault(_CACHE, {})
    seg = cache.get(path)
    if seg is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only: never written here
            seg = cache[path] = Segment.attach(path, populate=True, writable=False)
    return seg


def forget_retired(worker: Any, paths: Iterable[str]) -> None:
    """Drop the mappings of buffers the sender retired (views keep theirs alive)."""
    cache = receiver_state(worker).scratch.get(_CACHE, {})
    for p in paths:
        cache.pop(p, None)


def open_views(worker: Any, path: str, layout: Layout) -> dict[str, torch.Tensor]:
    """Views of every tensor of the packed buffer ``path`` (a name or a path in
    ``/dev/shm``); the mapping is kept on ``worker`` for the next version."""
    return views(_mapping(worker, path).tensor, layout)


def receive(
    worker: Any, layout: Layout, payload: dict[str, Any], skip: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    forget_retired(worker, payload.get("retired", ()))
    if skip:
        return {}, lambda: None
    return open_views(worker, payload["path"], layout), lambda: None
