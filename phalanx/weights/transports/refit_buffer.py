"""A refit buffer kept from version to version: packed by the policy, mapped once by readers.

The sender (``RefitBuffer``) allocates one flat buffer per layout, on the weights' device:
a shared-memory segment on the CPU, CUDA memory on a GPU. Every version sent in that
layout is cast and copied into typed views of the same buffer in one multi-tensor copy,
and the handle made when it was allocated (the segment's name, or a CUDA IPC handle) is
sent again. A layout that differs (other names, shapes or dtype) gets a new buffer, under
a new ``buffer`` id; the old one is released here (its segment unlinked).

A reader (``mapped_views``) opens a buffer once and keeps the mapping and its views,
keyed by the buffer's id; a handle of another buffer releases the old mapping first.

Ordering: the sender writes the buffer in place, so a reader must not read it while a
later version is packed. ``RefitBuffer.pack`` returns once the bytes are written (on a
GPU, after the device finished); the caller hands the handle over only then, and packs
the next version only after every reader returned from its copy (on a GPU, a reader
synchronizes its device before returning). Synchronous refits between phases (GRPO's
generate, then train, then refit) keep that order.
"""

from __future__ import annotations

import os
import uuid
import warnings
from typing import Any

import torch

from phalanx.comm.cuda_ipc import open_handle, share
from phalanx.comm.shm import Segment, segment_path
from phalanx.weights.layout import Layout, views
from phalanx.worker.weights_state import receiver_state

_CACHE = "refit_buffer"


def layout_key(layout: Layout) -> tuple[Any, ...]:
    """What makes two layouts lay bytes out alike (specs, total size, tied names)."""
    return (tuple(layout.specs), layout.total_bytes, tuple(sorted(layout.aliases.items())))


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i (casting), as one multi-tensor copy."""
    if dst:
        torch._foreach_copy_(dst, src)


class RefitBuffer:
    """The sending side: one buffer for the current layout, rewritten by each version.

    Args:
        device: where the buffer lives (CUDA: a CUDA IPC buffer; CPU: shared memory).
    """

    def __init__(self, device: torch.device) -> None:
        if not isinstance(device, torch.device) or device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"RefitBuffer: device must be a CPU or CUDA torch.device, got {device!r}"
            )
        self.device = device
        self.allocations = 0  # buffers allocated so far (one per layout change)
        self._key: tuple[Any, ...] | None = None
        self._layout: Layout | None = None  # the last layout packed (its key is _key)
        self._flat: torch.Tensor | None = None
        self._segment: Segment | None = None
        self._views: list[torch.Tensor] = []
        self._handle: dict[str, Any] | None = None

    @property
    def flat(self) -> torch.Tensor | None:
        """The current buffer (uint8), or None before the first ``pack``."""
        return self._flat

    def pack(self, layout: Layout, sources: list[torch.Tensor]) -> dict[str, Any]:
        """Write ``sources`` (one per spec of ``layout``) into the buffer; its handle.

        The handle is ``{"kind": "cuda_ipc" | "shm", "layout", "buffer", ...}``: the same
        object for every version of one layout. Returns once the bytes are written. The
        layout packed last is recognised by identity (a layout is not edited in place).
        """
        if len(sources) != len(layout.specs):
            raise ValueError(
                f"RefitBuffer.pack: {len(sources)} sources for {len(layout.specs)} specs"
            )
        if layout is not self._layout:  # a layout object seen before lays bytes out alike
            key = layout_key(layout)
            if key != self._key:
                self._allocate(layout, key)
            self._layout = layout
        copy_all(self._views, sources)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._handle  # type: ignore[return-value]

    def _allocate(self, layout: Layout, key: tuple[Any, ...]) -> None:
        self.release()
        buffer = uuid.uuid4().hex
        if self.device.type == "cuda":
            flat = torch.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
            handle = {"kind": "cuda_ipc", **share(flat)}
        else:
            self._segment = Segment.create(layout.total_bytes, tag="w")
            flat = self._segment.tensor[: layout.total_bytes]
            handle = {"kind": "shm", "name": self._segment.name}
        self._flat = flat
        self._views = list(views(flat, layout).values())
        self._handle = {**handle, "layout": layout, "buffer": buffer}
        self._key = key
        self.allocations += 1

    def release(self) -> None:
        """Drop the buffer (a shared-memory segment is unlinked; readers' mappings stay
        valid until they drop them)."""
        if self._segment is not None:
            self._segment.unlink()
        self._segment = self._flat = self._handle = self._key = self._layout = None
        self._views = []


def _buffer_id(handle: dict[str, Any]) -> str | None:
    """The id of the buffer behind ``handle``: its ``buffer`` entry; for a shared-memory
    handle packed elsewhere, its segment's name and inode (a segment made again under the
    same name is another buffer); None for a CUDA IPC handle without one."""
    if "buffer" in handle:
        return str(handle["buffer"])
    if handle["kind"] == "shm":
        return f"shm:{handle['name']}:{os.stat(segment_path(handle['name'])).st_ino}"
    return None


def mapped_views(worker: Any, handle: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Views of every tensor in the buffer of ``handle``, mapped once per buffer.

    The mapping (and the views) stay on ``worker`` for the next version in the same buffer;
    a handle of another buffer (the sender's layout changed) releases the old one first. A
    CUDA IPC handle without a ``buffer`` id (not from ``RefitBuffer``) is opened for this
    call only; ``worker`` may then be None.
    """
    kind = handle.get("kind")
    if kind not in ("shm", "cuda_ipc"):
        raise ValueError(f"handle: kind must be 'shm' or 'cuda_ipc', got {kind!r}")
    layout = handle["layout"]
    buffer = _buffer_id(handle)
    if buffer is None:
        if worker is not None:
            forget_mapping(worker)
        return views(open_handle(handle), layout)
    scratch = receiver_state(worker).scratch
    cached = scratch.get(_CACHE)
    if cached is not None and cached["buffer"] == buffer:
        # A RefitBuffer's id names one layout (a new layout gets a new buffer); a segment
        # packed elsewhere may be rewritten in another layout under the same name.
        if "buffer" not in handle and cached["key"] != layout_key(layout):
            cached["views"] = views(cached["flat"], layout)
            cached["key"] = layout_key(layout)
        return cached["views"]
    scratch.pop(_CACHE, None)  # the old buffer's mapping goes with its last reference
    if kind == "shm":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only: never written here
            flat = Segment.attach(handle["name"], populate=True, writable=False).tensor
    else:
        flat = open_handle(handle)
    scratch[_CACHE] = {
        "buffer": buffer,
        "flat": flat,
        "key": layout_key(layout),
        "views": views(flat, layout),
    }
    return scratch[_CACHE]["views"]


def mapped_buffer(worker: Any) -> torch.Tensor | None:
    """The buffer ``worker`` keeps mapped (None if none): tests check its identity."""
    cached = receiver_state(worker).scratch.get(_CACHE)
    return None if cached is None else cached["flat"]


def forget_mapping(worker: Any) -> None:
    """Release the buffer ``worker`` keeps mapped."""
    receiver_state(worker).scratch.pop(_CACHE, None)
