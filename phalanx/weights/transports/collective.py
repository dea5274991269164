"""Collective transport: a bucketed broadcast over gloo (CPU) or NCCL (GPU).

The sender is rank 0 of a process group made for exactly the receivers it targets,
independent of any default ``torch.distributed`` group the workers use themselves (a
worker training with FSDP keeps its own). Buckets are fixed-size byte ranges of the
stream; the sender packs bucket k+1 into one buffer while bucket k is still being sent
from the other, and receivers fill a staging buffer that is applied whole, so a version
is never half applied. Process groups are cached per target set and rebuilt when a
worker was restarted.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Layout, as_bytes, pack_range, views


def new_process_group(
    store: dist.Store, key: str, rank: int, world: int, backend: str, timeout_s: float
) -> Any:
    """A process group of its own (not the default one) over ``store``."""
    prefixed = dist.PrefixStore(f"phalanx_weights/{key}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def broadcast(pg: Any, tensor: torch.Tensor, root: int = 0) -> Any:
    """Start broadcasting ``tensor`` from ``root``; returns the work to wait on."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def broadcast_stream(
    pg: Any,
    layout: Layout,
    sources: list[torch.Tensor],
    bucket_bytes: int,
    device: torch.device | str = "cpu",
) -> None:
    """Sender side: pack and broadcast the stream bucket by bucket, double-buffered."""
    ranges = layout.buckets(bucket_bytes)
    if not ranges:
        return
    size = max(e - s for s, e in ranges)
    bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(2, len(ranges)))]
    works: list[Any] = [None] * len(bufs)
    direct: list[Any] = []
    for k, (s, e) in enumerate(ranges):
        view = _direct_view(layout, sources, s, e, device)
        if view is not None:  # the bucket is one tensor's own bytes: no packing
            direct.append(broadcast(pg, view))
            continue
        i = k % len(bufs)
        if works[i] is not None:
            works[i].wait()
        pack_range(bufs[i][: e - s], layout, sources, s, e)
        works[i] = broadcast(pg, bufs[i][: e - s])
    for w in [*works, *direct]:
        if w is not None:
            w.wait()


def _direct_view(
    layout: Layout, sources: list[torch.Tensor], start: int, end: int, device: Any
) -> torch.Tensor | None:
    """The bytes ``[start, end)`` as a view of a single source tensor, if they are one."""
    for spec, src in zip(layout.specs, sources):
        if spec.offset <= start and end <= spec.offset + spec.nbytes:
            if (
                src.dtype == spec.torch_dtype
                and src.is_contiguous()
                and src.device == torch.device(device)
            ):
                return as_bytes(src)[start - spec.offset : end - spec.offset]
            return None
        if spec.offset >= end:
            return None
    return None


def broadcast_packed(pg: Any, flat: torch.Tensor, bucket_bytes: int) -> None:
    """Sender side: broadcast an already packed stream in buckets (used by ``send_async``)."""
    works = [
        broadcast(pg, flat[s : min(s + bucket_bytes, flat.numel())])
        for s in range(0, flat.numel(), bucket_bytes)
    ]
    for w in works:
        w.wait()


def receive_stream(
    pg: Any, layout: Layout, bucket_bytes: int, device: Any = "cpu", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Receiver side: the whole stream, received bucket by bucket into one staging buffer
    (``out`` if given, at least ``layout.total_bytes`` long)."""
    flat = (
        out
        if out is not None
        else torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    )
    works = [broadcast(pg, flat[s:e]) for s, e in layout.buckets(bucket_bytes)]
    for w in works:
        w.wait()
    return flat


# -- receiver half, run on the worker host -------------------------------------------------

_lock = threading.Lock()


def _groups(host: Any) -> dict[str, Any]:
    with _lock:
        return host.__dict__.setdefault("_px_weight_pgs", {})


def join(
    host: Any, key: str, addr: str, port: int, world: int, rank: int, backend: str, timeout_s: float
) -> bool:
    """Join the sender's process group ``key`` as ``rank`` (blocks until all joined)."""
    store = dist.TCPStore(addr, port, world, False, timeout=datetime.timedelta(seconds=timeout_s))
    pg = new_process_group(store, key, rank, world, backend, timeout_s)
    _groups(host)[key] = (pg, store, backend)
    return True


def drop(host: Any, key: str) -> bool:
    return _groups(host).pop(key, None) is not None


def receive(
    host: Any, layout: Layout, payload: dict[str, Any], skip: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    entry = _groups(host).get(payload["key"])
    if entry is None:
        raise RuntimeError(f"collective weights group {payload['key']!r} was not joined here")
    pg, _, backend = entry
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    with _groups_lock(host):
        return _receive_staged(host, layout, payload, skip, pg, device)


def _groups_lock(host: Any) -> threading.Lock:
    with _lock:
        return host.__dict__.setdefault("_px_weight_recv_lock", threading.Lock())


def _receive_staged(
    host: Any, layout: Layout, payload: dict[str, Any], skip: bool, pg: Any, device: Any
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    # The staging buffer is kept between versions: no allocation or page faults per send.
    staging = host.__dict__.get("_px_weight_staging")
    if (
        staging is None
        or staging.numel() < layout.total_bytes
        or staging.device != torch.device(device)
    ):
        staging = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        host._px_weight_staging = staging
    flat = receive_stream(
        pg, layout, payload["bucket_bytes"], device, staging[: layout.total_bytes]
    )
    return ({} if skip else views(flat, layout)), lambda: None
