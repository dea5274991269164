"""Collective transport: a bucketed broadcast over gloo (CPU) or NCCL (GPU).

The sender is rank 0 of a process group made for exactly the receivers it targets,
independent of any default ``torch.distributed`` group the workers use themselves (a
worker training with FSDP keeps its own). Process groups are cached per target set and
rebuilt when a worker was restarted.

Both sides cut the stream by the same plan (``plan``): a tensor of at least
``min(bucket, 1 MiB)`` goes as its own segments (bucket-sized slices of its bytes),
broadcast straight from the sender's tensor into the receiver's parameter; smaller
tensors are packed together into buckets of at most ``bucket`` bytes, double-buffered
on both sides so packing (or unpacking) one overlaps the transfer of the next.

Atomicity: a receiver that is idle takes its model's write lock *before* the first byte
arrives and receives in place; no method call runs until the whole version is in, and
``weights_version`` moves only after the last byte. If the transfer breaks midway (a peer
died, a timeout), the version is not claimed, the worker records ``weights_torn``
(the version it was receiving) and the sender re-sends that whole version to every
survivor through the object store, which clears it. A receiver busy in a method call
cannot take the lock without stalling everyone, so it receives into a staging buffer
(kept between versions) and applies that whole once the call ends; so do receivers that
ignore the version or whose module does not match (their call then fails, unchanged).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from phalanx.comm.process_group import broadcast, join_store, make_process_group
from phalanx.weights.layout import Layout, as_bytes, pack_range, unpack_range, views
from phalanx.worker.weights_state import receiver_state

_DIRECT_MIN = 1 << 20


def new_process_group(
    store: Any, key: str, rank: int, world: int, backend: str, timeout_s: float
) -> Any:
    """The weights layer's process group ``key`` over ``store`` (``comm.process_group``)."""
    return make_process_group(
        backend, store, rank, world, prefix=f"phalanx_weights/{key}", timeout_s=timeout_s
    )


def plan(layout: Layout, bucket_bytes: int) -> list[tuple[int, int, int]]:
    """The segments ``(start, end, spec index or -1 for a packed bucket)`` of the stream."""
    direct_min = min(bucket_bytes, _DIRECT_MIN)
    segs: list[tuple[int, int, int]] = []
    open_at: int | None = None  # start of the packed bucket being filled
    last_end = 0
    for i, spec in enumerate(layout.specs):
        end = spec.offset + spec.nbytes
        if spec.nbytes >= direct_min:
            if open_at is not None:
                segs.append((open_at, last_end, -1))
                open_at = None
            segs.extend(
                (s, min(s + bucket_bytes, end), i) for s in range(spec.offset, end, bucket_bytes)
            )
            continue
        if open_at is not None and end - open_at > bucket_bytes:
            segs.append((open_at, last_end, -1))
            open_at = None
        if open_at is None:
            open_at = spec.offset
        last_end = end
    if open_at is not None:
        segs.append((open_at, last_end, -1))
    return [seg for seg in segs if seg[1] > seg[0]]


def _buffer(cache: list[torch.Tensor], i: int, size: int, device: Any) -> torch.Tensor:
    """Reusable buffer ``i`` of at least ``size`` bytes (kept in ``cache`` between sends)."""
    while len(cache) <= i:
        cache.append(torch.empty(0, dtype=torch.uint8, device=device))
    if cache[i].numel() < size or cache[i].device != torch.device(device):
        cache[i] = torch.empty(size, dtype=torch.uint8, device=device)
    return cache[i]


class _DoubleBuffer:
    """Two rotating buffers: a slot is reused only after its transfer and ``done`` ran."""

    def __init__(self, cache: list[torch.Tensor], size: int, device: Any):
        self.bufs = [_buffer(cache, i, size, device) for i in range(2)]
        self.slots: list[tuple[Any, int, int] | None] = [None, None]
        self.k = 0

    def next(self, done: Callable[[torch.Tensor, int, int], None]) -> tuple[int, torch.Tensor]:
        i = self.k % 2
        self.k += 1
        self._finish(i, done)
        return i, self.bufs[i]

    def _finish(self, i: int, done: Callable[[torch.Tensor, int, int], None]) -> None:
        slot = self.slots[i]
        if slot is not None:
            work, s, e = slot
            work.wait()
            done(self.bufs[i][: e - s], s, e)
            self.slots[i] = None

    def drain(self, done: Callable[[torch.Tensor, int, int], None]) -> None:
        for i in (self.k % 2, (self.k + 1) % 2):  # oldest first
            self._finish(i, done)


def _no_op(buf: torch.Tensor, start: int, end: int) -> None:
    return None


def broadcast_stream(
    pg: Any,
    layout: Layout,
    sources: list[torch.Tensor],
    bucket_bytes: int,
    device: torch.device | str = "cpu",
    buffers: list[torch.Tensor] | None = None,
) -> None:
    """Sender side: broadcast the stream by ``plan``; large tensors straight from their
    storage, the rest packed into two rotating buffers (``buffers`` keeps them)."""
    segs = plan(layout, bucket_bytes)
    if not segs:
        return
    cache = buffers if buffers is not None else []
    dbuf: _DoubleBuffer | None = None
    works = []
    for s, e, i in segs:
        view = _source_view(layout.specs[i], sources[i], s, e, device) if i >= 0 else None
        if view is not None:
            works.append(broadcast(pg, view))
            continue
        if dbuf is None:
            dbuf = _DoubleBuffer(cache, max(b - a for a, b, _ in segs), device)
        slot, buf = dbuf.next(_no_op)
        pack_range(buf[: e - s], layout, sources, s, e)
        work = broadcast(pg, buf[: e - s])
        dbuf.slots[slot] = (work, s, e)
    if dbuf is not None:
        dbuf.drain(_no_op)
    for w in works:
        w.wait()


def _source_view(spec: Any, src: torch.Tensor, start: int, end: int, device: Any) -> Any:
    """Bytes ``[start, end)`` of the stream as a view of ``src``, if no cast or move is needed."""
    if src.dtype == spec.torch_dtype and src.is_contiguous() and src.device == torch.device(device):
        return as_bytes(src)[start - spec.offset : end - spec.offset]
    return None


def receive_stream(
    pg: Any, layout: Layout, bucket_bytes: int, device: Any = "cpu", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Receiver side: the whole stream, received by ``plan`` into one staging buffer
    (``out`` if given, at least ``layout.total_bytes`` long)."""
    flat = (
        out
        if out is not None
        else torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    )
    works = [broadcast(pg, flat[s:e]) for s, e, _ in plan(layout, bucket_bytes)]
    for w in works:
        w.wait()
    return flat


def receive_into(
    pg: Any,
    layout: Layout,
    targets: list[torch.Tensor],
    bucket_bytes: int,
    device: Any = "cpu",
    buffers: list[torch.Tensor] | None = None,
) -> None:
    """Receiver side, in place: segments of a large tensor land in its target's storage,
    packed buckets go through two rotating buffers and are unpacked into their targets.
    ``targets`` (one per spec) must be contiguous and of the spec's dtype and shape."""
    segs = plan(layout, bucket_bytes)
    cache = buffers if buffers is not None else []
    dbuf: _DoubleBuffer | None = None

    def unpack(buf: torch.Tensor, start: int, end: int) -> None:
        unpack_range(buf, layout, targets, start, end)

    works = []
    for s, e, i in segs:
        if i >= 0:
            spec = layout.specs[i]
            works.append(broadcast(pg, as_bytes(targets[i])[s - spec.offset : e - spec.offset]))
            continue
        if dbuf is None:
            dbuf = _DoubleBuffer(cache, max(b - a for a, b, _ in segs), device)
        slot, buf = dbuf.next(unpack)
        dbuf.slots[slot] = (broadcast(pg, buf[: e - s]), s, e)
    if dbuf is not None:
        dbuf.drain(unpack)
    for w in works:
        w.wait()


# -- receiver half, run on the worker -------------------------------------------------------

_lock = threading.Lock()


def _scratch(worker: Any, name: str, default: Any) -> Any:
    with _lock:
        return receiver_state(worker).scratch.setdefault(name, default)


def _groups(worker: Any) -> dict[str, Any]:
    return _scratch(worker, "pgs", {})


def join(
    worker: Any,
    key: str,
    addr: str,
    port: int,
    world: int,
    rank: int,
    backend: str,
    timeout_s: float,
) -> bool:
    """Join the sender's process group ``key`` as ``rank`` (blocks until all joined)."""
    store = join_store(addr, port, timeout_s, world)
    pg = new_process_group(store, key, rank, world, backend, timeout_s)
    _groups(worker)[key] = (pg, store, backend)
    return True


def drop(worker: Any, key: str) -> bool:
    return _groups(worker).pop(key, None) is not None


def _group(worker: Any, payload: dict[str, Any]) -> tuple[Any, Any]:
    entry = _groups(worker).get(payload["key"])
    if entry is None:
        raise RuntimeError(f"collective weights group {payload['key']!r} was not joined here")
    pg, _, backend = entry
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    return pg, device


def receive(
    worker: Any, layout: Layout, payload: dict[str, Any], skip: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    pg, device = _group(worker, payload)
    with _scratch(worker, "recv_lock", threading.Lock()):
        return _receive_staged(worker, layout, payload, skip, pg, device)


def apply_in_place(
    worker: Any, version: int, layout: Layout, payload: dict[str, Any], lock: Any, strict: bool
) -> str | None:
    """Receive ``version`` straight into the worker's parameters under the write lock.

    Returns "applied" (or "ignored" if a newer version landed meanwhile), or None with
    nothing received when that cannot be done here (the worker is in a method call, a
    target is not contiguous, its parameters view a shared buffer, or the module does not
    match); the caller then stages. A transfer that breaks midway raises with the version
    unclaimed and ``weights_torn`` set (see the module docstring).
    """
    from phalanx.weights.receiver import copy_aliases, module_of, target_tensors, validate

    state = receiver_state(worker)
    if state.view is not None:
        return None  # the staged path gives it private storage first
    try:
        targets = target_tensors(module_of(worker))
        missing = validate(targets, layout, strict)
    except Exception:  # noqa: BLE001 - staged: it raises again after the broadcast
        return None  # (the others need this worker in the broadcast), nothing changed
    dsts = [targets[spec.name].detach() for spec in layout.specs]
    if not all(t.is_contiguous() for t in dsts):
        return None
    pg, device = _group(worker, payload)
    entered = False
    try:
        with _scratch(worker, "recv_lock", threading.Lock()), lock.write(0.0):
            entered = True
            if version <= state.version:  # a newer one landed meanwhile
                _receive_staged(worker, layout, payload, True, pg, device)
                return "ignored"
            buffers = _scratch(worker, "buffers", [])
            try:
                receive_into(pg, layout, dsts, payload["bucket_bytes"], device, buffers)
            except BaseException:
                state.torn = version
                raise
            with torch.no_grad():
                copy_aliases(targets, layout)
            state.version = version
            state.torn = 0
            state.missing = missing
    except TimeoutError:
        if entered:
            raise
        return None  # busy in a method call: stage instead of stalling the broadcast
    return "applied"


def _receive_staged(
    worker: Any, layout: Layout, payload: dict[str, Any], skip: bool, pg: Any, device: Any
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    # The staging buffer is kept between versions: no allocation or page faults per send.
    scratch = receiver_state(worker).scratch
    staging = scratch.get("staging")
    if (
        staging is None
        or staging.numel() < layout.total_bytes
        or staging.device != torch.device(device)
    ):
        staging = scratch["staging"] = torch.empty(
            layout.total_bytes, dtype=torch.uint8, device=device
        )
    flat = receive_stream(
        pg, layout, payload["bucket_bytes"], device, staging[: layout.total_bytes]
    )
    return ({} if skip else views(flat, layout)), lambda: None
