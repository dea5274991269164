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
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from phalanx.comm.process_group import broadcast, host_store, join_store, make_process_group
from phalanx.weights.layout import Layout, as_bytes, pack_range, unpack_range, views
from phalanx.weights.targets import copy_aliases, module_of, target_tensors, validate
from phalanx.weights.transports.base import Delivery, SenderHalf
from phalanx.worker.weights_state import receiver_state

_DIRECT_MIN = 1 << 20
_PING_TIMEOUT_S = 10.0


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


# -- sender half, run on the driver ----------------------------------------------------------


def ping(
    actors: Mapping[int, Any], timeout_s: float = _PING_TIMEOUT_S
) -> tuple[list[int], dict[int, str]]:
    """Ping phalanx worker ``actors`` (rank -> handle): the ranks alive, and why the others are not."""
    refs = {r: a._px_ping.remote() for r, a in actors.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    alive, dead = [], {}
    for r, ref in refs.items():
        if ref not in ready:
            dead[r] = f"did not answer a ping within {timeout_s}s"
            continue
        try:
            ray.get(ref)
            alive.append(r)
        except (RayActorError, RayTaskError) as e:
            dead[r] = f"worker died: {type(e).__name__}"
    return alive, dead


class CollectiveSender(SenderHalf):
    """Rank 0 of a process group per set of receivers (cached, rebuilt when one of them
    was restarted); broadcasts each version by ``plan``. ``place`` pings the receivers
    and records the dead ones in ``send.dead``; ``start`` broadcasts (in a thread when
    the caller keeps training: ``snapshot``)."""

    def __init__(self, owner: Any):
        super().__init__(owner)
        self._store: Any = None
        self._pgs: dict[tuple, tuple[str, Any]] = {}
        self._buffers: list[torch.Tensor] = []  # the double buffer, reused
        self._snapshot: torch.Tensor | None = None  # send_async snapshot, reused
        self._group: tuple[Any, torch.device] | None = None  # (pg, device) of the send

    def place(self, send: Delivery, ranks: list[int]) -> dict[str, Any] | None:
        alive, dead = ping({r: self.owner.group.actors[r] for r in ranks})
        send.dead.update(dead)
        if not alive:
            return None
        backend = self.owner.backend or (
            "nccl" if send.sources and send.sources[0].device.type == "cuda" else "gloo"
        )
        device = send.sources[0].device if backend == "nccl" else torch.device("cpu")
        key, pg = self.process_group(alive, backend)
        self._group = (pg, device)
        return {"key": key, "bucket_bytes": self.owner.bucket_bytes}

    def start(self, send: Delivery, snapshot: bool) -> None:
        if self._group is None:
            return
        (pg, device), self._group = self._group, None
        bucket = self.owner.bucket_bytes
        if not snapshot:
            t1 = time.perf_counter()
            try:
                with self.owner.timers.span("weights/pack"):  # pack and broadcast overlap
                    broadcast_stream(pg, send.layout, send.sources, bucket, device, self._buffers)
            except Exception as e:  # noqa: BLE001 - a receiver died; the sender re-sends
                send.thread_error.append(e)
            send.timings["broadcast"] = time.perf_counter() - t1
            return
        # The caller keeps training: copy once into a snapshot kept between sends, then
        # broadcast from it in a thread (large tensors straight from its views).
        t1 = time.perf_counter()
        with self.owner.timers.span("weights/pack"):
            flat = self._snapshot_buffer(send.layout.total_bytes, device)
            pack_range(flat, send.layout, send.sources, 0, send.layout.total_bytes)
        send.timings["pack"] = time.perf_counter() - t1
        send.sources = list(views(flat, send.layout).values())
        send.keep.append(flat)
        buffers = self._buffers

        def run() -> None:
            try:
                broadcast_stream(pg, send.layout, send.sources, bucket, device, buffers)
            except BaseException as e:  # noqa: BLE001 - reported by wait_async
                send.thread_error.append(e)

        send.thread = threading.Thread(target=run, name="phalanx-weights-bcast", daemon=True)
        send.thread.start()

    def finish(self, send: Delivery, deadline: float) -> None:
        if send.thread is not None:
            send.thread.join(max(0.0, deadline - time.perf_counter()))
            if send.thread.is_alive():  # a stuck broadcast still holds these: use new ones
                self._buffers, self._snapshot = [], None

    def drop_groups(self) -> None:
        """Forget every process group (the receivers still alive forget theirs too)."""
        actors = self.owner.group.actors
        for ident, (key, _) in list(self._pgs.items()):
            for r, actor_id in zip(ident[1], ident[2]):
                if r < len(actors) and actors[r]._actor_id.hex() == actor_id:
                    actors[r].px_side_call.remote(drop, key)
        self._pgs.clear()

    def close(self) -> None:
        self._pgs = {}
        self._buffers, self._snapshot = [], None

    def _snapshot_buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` for ``send_async`` snapshots, reused between sends
        (a fresh one costs page faults comparable to the copy itself)."""
        buf = self._snapshot
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._snapshot = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]

    def process_group(self, ranks: list[int], backend: str) -> tuple[str, Any]:
        """The key and process group of ``ranks`` (made, and joined by them, when new)."""
        actors = self.owner.group.actors
        ident = (backend, tuple(ranks), tuple(actors[r]._actor_id.hex() for r in ranks))
        if ident in self._pgs:
            return self._pgs[ident]
        addr = ray.util.get_node_ip_address()
        if self._store is None:
            self._store = host_store(addr, self.owner.timeout_s)
        key = uuid.uuid4().hex[:12]
        world = len(ranks) + 1
        timeout = min(self.owner.timeout_s, 120.0)
        joins = [
            actors[r].px_side_call.remote(
                join, key, addr, self._store.port, world, i + 1, backend, timeout
            )
            for i, r in enumerate(ranks)
        ]
        pg = new_process_group(self._store, key, 0, world, backend, timeout)
        ray.get(joins, timeout=timeout)
        self._pgs[ident] = (key, pg)
        return key, pg
