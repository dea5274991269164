"""Object-store transport: one ``ray.put`` of the bytes, zero-copy numpy views on every receiver.

Without a dtype cast the tensors' own bytes are put directly (one copy, into the store);
with a cast (or from GPU) the stream is packed bucket by bucket into a buffer the sender
keeps between sends, each bucket put on its own, so the sender never holds a second full
copy. Receivers read the store's shared memory without copying and copy once, into their
parameters.

Where the time goes (512 MB, 4 receivers, one node): the put is one memcpy and the
receivers' copies are the floor, but every put writes a new object. When the store
places it in memory no earlier object used, each page is faulted in first, which on a
VM costs several times the copy itself. The store frees the previous version
asynchronously, so back-to-back sends cycle over a few regions until all are warm; after
that a send is close to the same-node shared-memory transport, which avoids the issue
by reusing one segment (and is what ``transport="auto"`` picks on one node).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from phalanx.weights.layout import Layout, as_bytes, pack_range, views
from phalanx.weights.transports.base import Delivery, SenderHalf


def needs_packing(layout: Layout, sources: list[torch.Tensor]) -> bool:
    return any(
        s.dtype != spec.torch_dtype or s.device.type != "cpu"
        for spec, s in zip(layout.specs, sources)
    )


def put(
    layout: Layout,
    sources: list[torch.Tensor],
    bucket_bytes: int,
    buffer: torch.Tensor | None = None,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Put the stream in the object store; returns (the payload every receiver gets,
    the packing buffer to pass back next time: reusing it avoids faulting fresh pages)."""
    if not needs_packing(layout, sources):
        arrays = [as_bytes(s).numpy() for s in sources]
        return {"mode": "whole", "refs": [ray.put(arrays)]}, buffer
    ranges = layout.buckets(bucket_bytes)
    size = max((e - s for s, e in ranges), default=0)
    buf = buffer
    if buf is None or buf.numel() < size:
        buf = torch.empty(size, dtype=torch.uint8)
    refs = []
    for s, e in ranges:
        pack_range(buf[: e - s], layout, sources, s, e)
        refs.append(ray.put(buf[: e - s].numpy()))  # put copies: the buffer is reused
    return {"mode": "buckets", "refs": refs, "bucket_bytes": bucket_bytes}, buf


class ObjectStoreSender(SenderHalf):
    """Puts each version once for all its receivers; keeps the packing buffer and the
    latest payload (to restore restarted workers without packing again)."""

    def __init__(self, owner: Any):
        super().__init__(owner)
        self.buffer: torch.Tensor | None = None
        self.last: tuple[int, Layout, Any] | None = None  # (version, layout, payload)

    def place(self, send: Delivery, ranks: list[int]) -> dict[str, Any]:
        return self.put(send.version, send.layout, send.sources)

    def put(self, version: int, layout: Layout, sources: list[torch.Tensor]) -> dict[str, Any]:
        """Put ``version``'s stream; the payload (also kept as ``last``)."""
        payload, self.buffer = put(layout, sources, self.owner.bucket_bytes, self.buffer)
        self.last = (version, layout, payload)
        return payload

    def close(self) -> None:
        self.buffer = self.last = None


def _tensor(arr: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Store buffers are read-only; they are only ever read here.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def receive(
    worker: Any, layout: Layout, payload: dict[str, Any], skip: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    if skip:
        return {}, lambda: None
    got = ray.get(payload["refs"])
    if payload["mode"] == "whole":
        sources = {
            spec.name: _tensor(arr).view(spec.torch_dtype).view(spec.shape)
            for spec, arr in zip(layout.specs, got[0])
        }
        return sources, lambda: None
    bucket = payload["bucket_bytes"]
    flats = [_tensor(a) for a in got]
    sources = {}
    for spec in layout.specs:
        first, last = (
            spec.offset // bucket,
            max(spec.offset, spec.offset + spec.nbytes - 1) // bucket,
        )
        if first == last:
            base = first * bucket
            sources.update(views(flats[first][spec.offset - base :], _one(spec), spec.offset))
        else:  # spans buckets: its byte pieces, copied one by one into the target
            parts = []
            for b in range(first, last + 1):
                lo = max(spec.offset, b * bucket) - b * bucket
                hi = min(spec.offset + spec.nbytes, (b + 1) * bucket) - b * bucket
                parts.append(flats[b][lo:hi])
            sources[spec.name] = parts
    return sources, lambda: None


def _one(spec: Any) -> Layout:
    return Layout([spec], spec.nbytes)
