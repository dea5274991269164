"""The sending side: ``WeightSender`` and ``RayModuleTransformSender`` (TorchRL names).

``send`` snapshots the weights (from the sender's model, a module, a dict or a
TensorDict), moves them with the chosen transport and blocks until the chosen workers
applied them; ``send_async``/``wait_async`` split that in two so the sender can compute
meanwhile. Every send carries a new version; receivers ignore versions that are not
newer. A worker that dies does not stop the others: the ``SyncResult`` names it.

Checks before anything moves: by default (``strict=True``) the weights must cover every
parameter and buffer of the receivers' modules (``strict=False`` applies a partial
version, which the ``SyncResult`` reports in ``missing``), and every floating-point tensor
must be finite (``allow_nonfinite=True`` lets NaN/Inf through). A receiver that holds no
model is an error (``NoModelError``), not a failed rank.

The sender reaches each worker through the host's public side-call entry
(``WorkerHost.px_side_call``) with the receiver's operations (``receiver.*_op``).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from phalanx._base.checks import check_choice, check_int, check_number, check_ranks
from phalanx._base.timing import TimerRecorder
from phalanx.comm import shm as _shm_files
from phalanx.group.group import WorkerGroup
from phalanx.weights import receiver as _recv
from phalanx.weights.layout import (
    Layout,
    check_dtype,
    check_finite,
    check_name_map,
    check_sizes,
    gather,
    to_named_tensors,
    views,
)
from phalanx.weights.targets import NoModelError, WeightMismatchError
from phalanx.weights.transports.base import Delivery
from phalanx.weights.transports.collective import ping
from phalanx.weights.transports.registry import CHOICES, sender_halves
from phalanx.weights.transports.shm import is_full

__all__ = ["RayModuleTransformSender", "SyncResult", "WeightSender", "check_finite", "ping"]

_log = logging.getLogger(__name__)
_LATE = "did not apply within"  # a worker still busy: no re-send, it may yet apply


@dataclass
class SyncResult:
    """What one send did: who applied, who ignored it (not newer), who failed and why.

    Attributes:
        version: the send's version.
        applied: the ranks that applied it.
        ignored: the ranks that held a newer version.
        failed: each failed rank's error.
        timings: seconds per phase (``gather``, ``pack``, ``transfer``, ``apply``, ``total``).
        transport: the transport asked for.
        routes: the path each rank's bytes took: ``"shm"``, ``"shm_view"``, ``"cuda_ipc"``,
            ``"object_store"`` or ``"collective"``.
        missing: each rank's names not sent (a partial version, ``strict=False``).
    """

    version: int
    applied: list[int] = field(default_factory=list)
    ignored: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    transport: str = ""
    # rank -> the path its bytes took: "shm" (copied from shared memory), "shm_view" (its
    # parameters view the sender's shared buffer: read-only receivers), "cuda_ipc",
    # "object_store" or "collective"
    routes: dict[int, str] = field(default_factory=dict)
    missing: dict[int, list[str]] = field(default_factory=dict)  # rank -> names not sent

    @property
    def ok(self) -> bool:
        """True when no chosen worker failed."""
        return not self.failed

    @property
    def partial(self) -> bool:
        """True when some receiver got a partial version (``strict=False``)."""
        return any(self.missing.values())


class WeightSender:
    """Sends a model's weights to the workers of a group.

    ``WeightSender(group, model=None, *, transport="auto" | "object_store" | "shm" |
    "collective", bucket_size_mb=256, dtype=None, name_map=None)``.

    ``transport="auto"`` (the default) picks per receiver by one rule: on the sender's
    node, CPU weights go through shared memory (``shm``) and CUDA weights through CUDA
    IPC when the receiver holds the same GPU; every other receiver gets the object store.
    Same-node shared memory is preferred because its segment is reused from send to
    send, while every object-store put writes a new object (see ``object_store.py``).
    ``"shm"`` is the same rule without the GPU check; ``"object_store"`` and
    ``"collective"`` force one transport for everyone. ``dtype`` casts floating-point
    tensors on the way (e.g. fp32 master weights to bf16 receivers); ``name_map`` (a
    callable or dict; None drops a tensor) renames trainer names to receiver names.
    Neither materialises a second full copy on the sender.

    Receivers whose class sets ``read_only_weights = True`` (env runners, generation
    workers) on the sender's node take the shared buffer itself as their parameters
    (route ``"shm_view"``): a send is then one copy for all of them. The sender keeps a
    few buffers and rewrites one only when no receiver views it (see ``transports/shm.py``).
    Other processes on the node (a trainer's ranks) can write a version into one of them
    themselves: ``reserve_shared_buffer``, then ``send_prepared("shm", ...)``.

    A full ``/dev/shm`` (or more than ``shm_max_mb`` of it, default no limit): ``"auto"``
    sends those receivers' bytes through the object store instead and logs it once;
    ``"shm"`` raises an ``OSError`` (``ENOSPC``) naming ``/dev/shm`` and the size.

    ``strict`` (default True): weights that lack some of a receiver's parameters are an
    error; False applies them as a partial version. ``allow_nonfinite`` (default False):
    NaN/Inf in floating-point weights is an error raised before anything is sent.

    Args:
        group: the launched group whose workers receive.
        model: the module whose weights ``send()`` sends when given none.
        transport: ``"auto"``, ``"shm"``, ``"object_store"`` or ``"collective"``.
        bucket_size_mb: the size of one bucket of the collective and shm streams.
        dtype: cast floating-point tensors to this dtype on the way.
        name_map: a callable or dict renaming trainer names to receiver names.
        backend: the collective's backend (``"gloo"``, ``"nccl"``; None picks by device).
        timeout_s: seconds a send may take before the late workers count as failed.
        apply_timeout_s: seconds a worker may take to apply (``timeout_s`` if None).
        timers: where the send's phases are timed (a new recorder if None).
        strict: weights must cover every parameter and buffer of the receivers.
        allow_nonfinite: let NaN/Inf through.
        shm_max_mb: the most ``/dev/shm`` this sender may use (no limit if None).

    Raises:
        TypeError: ``group`` is not a ``WorkerGroup``, or an argument has the wrong type.
        ValueError: the group is not launched, or an argument is out of range.

    Example:
        >>> import torch
        >>> import phalanx as px
        >>> group = px.Worker.create_group().launch(
        ...     px.Cluster(), px.NodePlacement(num_workers=2), name="example_receivers")
        >>> def give_model(worker):
        ...     worker.model = torch.nn.Linear(4, 4)
        >>> _ = group.apply(give_model, [(0, (), {}), (1, (), {})]).wait()
        >>> sender = px.WeightSender(group, torch.nn.Linear(4, 4))
        >>> result = sender.send()
        >>> (result.ok, result.applied, result.version)
        (True, [0, 1], 1)
        >>> sender.close()
        >>> group.shutdown()
        True
    """

    def __init__(
        self,
        group: WorkerGroup,
        model: torch.nn.Module | None = None,
        *,
        transport: str = "auto",
        bucket_size_mb: float = 256,
        dtype: torch.dtype | None = None,
        name_map: Any = None,
        backend: str | None = None,
        timeout_s: float = 300.0,
        apply_timeout_s: float | None = None,
        timers: TimerRecorder | None = None,
        strict: bool = True,
        allow_nonfinite: bool = False,
        shm_max_mb: float | None = None,
    ):
        if not isinstance(group, WorkerGroup):
            raise TypeError(f"group must be a phalanx WorkerGroup, got {type(group).__name__}")
        if not group.actors:
            raise ValueError("group: the group is not launched (or was shut down)")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        check_choice(transport, CHOICES, "transport")
        check_choice(backend, (None, "gloo", "nccl"), "backend")
        if check_number(timeout_s, "timeout_s") <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if shm_max_mb is not None:
            check_number(shm_max_mb, "shm_max_mb", minimum=0)
        for flag, value in (("strict", strict), ("allow_nonfinite", allow_nonfinite)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        check_dtype(dtype)
        check_name_map(name_map)
        self.strict = strict
        self.allow_nonfinite = allow_nonfinite
        self.group = group
        self.model = model
        self.transport = transport
        self.bucket_bytes = check_sizes(bucket_size_mb)
        self.dtype = dtype
        self.name_map = name_map
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.apply_timeout_s = apply_timeout_s if apply_timeout_s is not None else self.timeout_s
        self.timers = timers if timers is not None else TimerRecorder()
        self.shm_max_bytes = None if shm_max_mb is None else int(shm_max_mb * 2**20)
        self._pending: Delivery | None = None
        self._transport_senders = sender_halves(self)  # transport name -> its sender half
        self._shm_sender = self._transport_senders["shm"]
        self._shm_full = False  # "auto" found /dev/shm full: the object store from then on
        self._last: tuple[int, Any, bool] | None = None  # (version, source, strict)
        self._prepared: tuple[int, Any, bool] | None = None  # the latest send_prepared
        # Start above whatever the workers already hold (e.g. from an earlier sender).
        self._version = max(self._query_versions(group.actors), default=0)
        _shm_files.reap_orphans()  # buffers of senders on this node that died mid-send
        # The hook holds the sender weakly: a sender nobody uses is collected, and its
        # finalizer (or close()) removes the hook from the group.
        remove = group.add_restart_hook(_RestoreHook(weakref.ref(self)))
        self._finalizer = weakref.finalize(self, WeightSender._cleanup, self.__dict__, remove)

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        """The version of the latest send started."""
        return self._version

    @property
    def shared_buffers(self) -> list[str]:
        """Paths of the same-node shared buffers this sender may still write (retired
        ones, which some receiver may still read, are not listed)."""
        return self._shm_sender.paths

    @property
    def pending(self) -> bool:
        """True while a ``send_async()`` (or ``send_prepared(wait=False)``) awaits ``wait_async()``."""
        return self._pending is not None

    def send(
        self,
        weights: Any = None,
        worker_ids: int | list[int] | None = None,
        *,
        strict: bool | None = None,
    ) -> SyncResult:
        """Send and block until the chosen workers applied the weights (all workers if None).

        ``strict`` overrides the sender's setting for this send (see the class docstring).

        Args:
            weights: a module, a dict of tensors or a TensorDict (the sender's model if None).
            worker_ids: one rank or a list of ranks (every worker if None).
            strict: this send's ``strict`` (the sender's if None).

        Returns:
            The ``SyncResult``: who applied, ignored or failed.

        Raises:
            RuntimeError: a ``send_async()`` is pending.
            WeightMismatchError: a receiver's parameters do not match the weights
                (``NoModelError`` when it holds no model).
            ValueError: ``weights`` is None and the sender has no model, a rank is out of
                range, or a tensor is not finite.
        """
        if self._pending is not None:
            raise RuntimeError("send(): a send_async() is pending; call wait_async() first")
        self._pending = self._start(weights, worker_ids, snapshot=False, strict=strict)
        return self.wait_async()

    def send_async(
        self,
        weights: Any = None,
        worker_ids: int | list[int] | None = None,
        *,
        strict: bool | None = None,
    ) -> None:
        """Start a send and return at once; ``wait_async()`` completes it.

        The weights are snapshot before this returns, so the sender may keep training.

        Args:
            weights: as for ``send``.
            worker_ids: as for ``send``.
            strict: as for ``send``.

        Raises:
            RuntimeError: a previous ``send_async()`` is still pending.
            ValueError: as for ``send``.
        """
        if self._pending is not None:
            raise RuntimeError("send_async(): a previous send_async() is still pending")
        self._pending = self._start(weights, worker_ids, snapshot=True, strict=strict)

    def wait_async(self) -> SyncResult:
        """Block until the pending ``send_async()`` was applied; ``RuntimeError`` if none is pending.

        Returns:
            The pending send's ``SyncResult``.

        Raises:
            RuntimeError: no send is pending.
            WeightMismatchError: as for ``send``.
        """
        pending = self._pending
        if pending is None:
            raise RuntimeError("wait_async(): no send_async() is pending")
        try:
            return self._finish(pending)
        finally:
            self._pending = None

    def update_weights(self, weights: Any) -> SyncResult:
        """Send ``weights`` to every worker and wait (TorchRL's ``update_weights``).

        Args:
            weights: as for ``send``.

        Returns:
            The ``SyncResult``.
        """
        return self.send(weights)

    def abandon_prepared(self) -> None:
        """Give up on a pending ``send_prepared(wait=False)`` without waiting for its acks.

        For a caller whose own part failed (e.g. the trainer's broadcast timed out): the
        receivers' halves then fail, or ignore the version, on their own. The version
        number stays used.
        """
        p = self._pending
        if p is None or not p.prepared:
            raise RuntimeError("abandon_prepared(): no send_prepared(wait=False) is pending")
        self._pending = None

    def send_prepared(
        self,
        transport: str,
        layout: Layout,
        payload: Any,
        worker_ids: int | list[int] | None = None,
        *,
        strict: bool | None = None,
        wait: bool = True,
        beside_calls: bool = True,
    ) -> SyncResult | None:
        """Apply a new version whose bytes another process already placed.

        For refits, where the trainer's own ranks write the weights: ``transport`` is the
        receiver half that reads them, ``payload`` what it reads: ``"shm"``:
        ``{"path": segment}``, either a buffer of this sender's ring that the writers
        filled (``reserve_shared_buffer``: ``read_only_weights`` receivers then take it as
        their parameters, route ``"shm_view"``, and it is rewritten only once no receiver
        holds it) or a segment the writer keeps until its next version (the receivers copy
        from it), ``"cuda_ipc"``: a ``comm.cuda_ipc`` handle, or
        ``"collective"``: ``{"key", "bucket_bytes"}`` of a weights process group the
        receivers joined (``receiver.collective_join_op``), whose rank 0 broadcasts the
        stream. ``wait=False`` returns at once (``wait_async()`` completes it), so the
        caller can start the broadcast. ``beside_calls=False`` receives through the
        group's ordinary call path (``group.apply``) instead of beside the method in flight:
        a busy worker then takes part only once its call ends (a refit broadcast then
        times out on it rather than wait). Versioning, validation, atomic apply and the
        ``SyncResult`` are those of ``send``; a restarted worker gets the last ``shm`` or
        ``cuda_ipc`` version again, while a ``collective`` one is not kept.

        Args:
            transport: the receiver half that reads the bytes: ``"shm"``, ``"cuda_ipc"`` or
                ``"collective"``.
            layout: the weights' ``Layout`` (names, shapes, dtypes, offsets).
            payload: what that half reads, a dict as above.
            worker_ids: as for ``send``.
            strict: as for ``send``.
            wait: block until applied; False returns at once.
            beside_calls: receive beside the method in flight rather than after it.

        Returns:
            The ``SyncResult``, or None when ``wait`` is False.

        Raises:
            TypeError: ``payload`` is not a dict or ``layout`` not a ``Layout``.
            ValueError: an ``"shm"`` payload lacks its ``path``.
            RuntimeError: a send is pending.
            WeightMismatchError: as for ``send``.
        """
        check_choice(transport, ("shm", "cuda_ipc", "collective"), "transport")
        if not isinstance(payload, Mapping):
            raise TypeError(f"payload must be a dict, got {type(payload).__name__}")
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a weights Layout, got {type(layout).__name__}")
        if self._pending is not None:
            raise RuntimeError("send_prepared(): a send is pending; call wait_async() first")
        strict = self._strict(strict)
        ranks = self._ranks(worker_ids)
        self._version += 1
        ring_path, kept = None, None
        if transport == "shm":
            if not isinstance(payload.get("path"), str):
                raise ValueError("send_prepared('shm'): payload needs the segment's 'path'")
            kept = self._shm_sender.commit(payload["path"], self._version)
            if kept is not None:  # one of our buffers: read-only receivers view it
                ring_path = kept.path
                retired = self._shm_sender.take_retired()
                payload = {"path": ring_path, "ring": True, "retired": retired}
            else:
                payload = {**payload, "ring": False}
        p = Delivery(self._version, ranks, transport, layout, [], time.perf_counter())
        p.strict, p.prepared, p.ring_path = strict, True, ring_path
        p.routes = dict.fromkeys(ranks, transport)
        if beside_calls:
            for r in ranks:
                p.refs[r] = self._apply_remote(r, transport, p.version, layout, payload, strict)
        else:
            args = (transport, p.version, layout, payload, self.apply_timeout_s, strict)
            handle = self.group.apply(
                _recv.apply_op, [(r, args, {}) for r in ranks], label="apply_weights"
            )
            p.refs.update(zip(handle.ranks, handle.refs))
        replay = None if transport == "collective" else (transport, layout, payload, kept)
        self._prepared = (p.version, replay, strict)
        self._pending = p
        return self.wait_async() if wait else None

    def reserve_shared_buffer(self, nbytes: int) -> str:
        """The path of a same-node shared buffer of at least ``nbytes`` for other processes
        to write the next version into (e.g. a trainer's ranks, each its own rows).

        The buffer comes from the sender's ring: no receiver views it, and it is not the
        newest version's (kept to restore restarted workers). Once it is written, pass
        ``{"path": path}`` to ``send_prepared("shm", layout, ...)``. The writers must map
        it on this node, and drop their mappings of buffers no longer in
        ``shared_buffers`` (retired ones), which would otherwise keep their memory alive.
        A reservation never sent is released by the next one.

        Args:
            nbytes: the size the writers need.

        Returns:
            The buffer's path.

        Raises:
            ValueError: ``nbytes`` is below 1.
            RuntimeError: a send is pending.
        """
        check_int(nbytes, "nbytes", minimum=1)
        if self._pending is not None:
            raise RuntimeError("reserve_shared_buffer(): a send is pending; call wait_async()")
        return self._shm_sender.reserve(nbytes)

    def close(self) -> None:
        """Release the shared buffers, the process groups, the last snapshot and the
        group's restart hook (a closed sender re-sends nothing)."""
        if self._pending is not None:
            self.wait_async()
        self._finalizer()

    # ------------------------------------------------------------------ internals
    def _query_versions(self, actors: list[Any]) -> list[int]:
        refs = [a.px_side_call.remote(_recv.version_op) for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=30)
        out = []
        for r in ready:
            try:
                out.append(int(ray.get(r)))
            except (RayActorError, RayTaskError):
                pass
        return out

    def _ranks(self, worker_ids: Any) -> list[int]:
        n = self.group.world_size
        if worker_ids is None:
            return list(range(n))
        ids = [worker_ids] if isinstance(worker_ids, int) else worker_ids
        if not isinstance(ids, (list, tuple)):
            raise TypeError(
                f"worker_ids must be None, an int or a list of ints, got {worker_ids!r}"
            )
        if not ids:
            raise ValueError("worker_ids is an empty list")
        return check_ranks(ids, n, "worker_ids", repeats="merge")

    def _strict(self, strict: Any) -> bool:
        if strict is not None and not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool or None, got {strict!r}")
        return self.strict if strict is None else strict

    def _named(self, weights: Any) -> Any:
        if weights is None:
            if self.model is None:
                raise ValueError(
                    "weights=None needs the sender's model: WeightSender(group, model)"
                )
            weights = self.model
        return to_named_tensors(weights)

    def _start(
        self, weights: Any, worker_ids: Any, snapshot: bool, strict: bool | None = None
    ) -> Delivery:
        strict = self._strict(strict)
        ranks = self._ranks(worker_ids)
        t0 = time.perf_counter()
        with self.timers.span("weights/gather"):
            named = self._named(weights)
            layout, sources = gather(named, name_map=self.name_map, dtype=self.dtype)
            if not self.allow_nonfinite:
                check_finite(layout, sources)
        timings = {"gather": time.perf_counter() - t0}
        self._version += 1
        version = self._version
        p = Delivery(version, ranks, self.transport, layout, sources, t0, timings, strict=strict)
        p.source = weights if weights is not None else self.model
        p.routes = self._route(ranks, sources)
        t1 = time.perf_counter()
        with self.timers.span("weights/pack"):
            payloads = self._place(p)
        if self.transport != "collective":  # the collective half times its own packing
            timings["pack"] = time.perf_counter() - t1
        for r in ranks:
            if r not in p.dead:
                kind = p.routes[r]
                p.refs[r] = self._apply_remote(r, kind, version, layout, payloads[kind], strict)
        for kind in payloads:
            self._transport_senders[kind].start(p, snapshot)
        return p

    def _apply_remote(
        self,
        rank: int,
        kind: str,
        version: int,
        layout: Layout,
        payload: Any,
        strict: bool = True,
    ) -> Any:
        actor = self.group.actors[rank]
        return actor.px_side_call.remote(
            _recv.apply_op, kind, version, layout, payload, self.apply_timeout_s, strict
        )

    def _route(self, ranks: list[int], sources: list[torch.Tensor]) -> dict[int, str]:
        """Per rank, the transport its payload takes (the ``transport="auto"`` rule)."""
        if self.transport in ("object_store", "collective"):
            return dict.fromkeys(ranks, self.transport)
        meta = self.group.worker_metadata
        here = ray.get_runtime_context().get_node_id()
        cuda = next((s.device for s in sources if s.device.type == "cuda"), None)
        gpu = _physical_gpu(cuda) if cuda is not None and self.transport == "auto" else None
        route = {}
        for r in ranks:
            local = meta[r].get("ray_node_id") == here
            if not local or (cuda is None and self._shm_full):
                route[r] = "object_store"
            elif cuda is None:
                route[r] = "shm"
            elif self.transport == "shm" or gpu in {str(g) for g in meta[r].get("gpu_ids") or ()}:
                route[r] = "cuda_ipc"
            else:
                route[r] = "object_store"
        return route

    def _place(self, p: Delivery) -> dict[str, Any]:
        """Each transport the routes name places the bytes once; its payload by name."""
        payloads: dict[str, Any] = {}
        kinds = list(dict.fromkeys(p.routes.values()))
        while kinds:
            kind = kinds.pop(0)
            members = [r for r in p.ranks if p.routes[r] == kind]
            try:
                payloads[kind] = self._transport_senders[kind].place(p, members)
            except OSError as e:
                if kind != "shm" or self.transport != "auto" or not is_full(e):
                    raise
                _log.warning("%s; this sender uses the object store instead from now on", e)
                self._shm_full = True
                p.routes.update(dict.fromkeys(members, "object_store"))
                if "object_store" not in payloads and "object_store" not in kinds:
                    kinds.append("object_store")
        p.keep.append(payloads)
        return payloads

    def _put(self, version: int, layout: Layout, sources: list[torch.Tensor]) -> dict[str, Any]:
        return self._transport_senders["object_store"].put(version, layout, sources)

    # -- completion ---------------------------------------------------------------------
    def _finish(self, p: Delivery) -> SyncResult:
        deadline = p.t0 + self.timeout_s
        for kind in dict.fromkeys(p.routes.values()):
            self._transport_senders[kind].finish(p, deadline)
        result = SyncResult(p.version, transport=p.transport, routes=p.routes)
        result.failed.update(p.dead)
        mismatches: dict[int, BaseException] = {}
        acks = self._collect(p.refs, deadline, result, mismatches)
        if p.ring_path is not None:
            # A worker that did not answer may still read the buffer later: it is retired
            # (never rewritten) rather than overwrite what it would read.
            holds = {r: a.get("holds") for r, a in acks.items()}
            unanswered = [r for r in result.failed if p.routes.get(r) == "shm"]
            self._shm_sender.settle(p.ring_path, holds, unanswered)
        broke = p.thread_error or (p.thread and p.thread.is_alive())
        errored = [
            r for r, why in result.failed.items() if r not in mismatches and _LATE not in why
        ]
        if p.transport == "collective" and not p.prepared and (broke or errored):
            # The broadcast broke (a receiver died mid-way) or a receiver failed in it (it
            # may be torn): drop the groups, re-send the same version to the survivors
            # through the object store.
            self._transport_senders["collective"].drop_groups()
            redo = [
                r
                for r in p.ranks
                if r not in result.applied and r not in result.ignored and r not in mismatches
            ]
            alive, dead = ping({r: self.group.actors[r] for r in redo})
            for r, why in dead.items():
                result.failed[r] = result.failed.get(r) or why
            for r in alive:
                result.failed.pop(r, None)
            if alive:
                payload = self._put(p.version, p.layout, p.sources)
                refs = {
                    r: self._apply_remote(r, "object_store", p.version, p.layout, payload, p.strict)
                    for r in alive
                }
                result.routes.update(dict.fromkeys(alive, "object_store"))
                acks.update(
                    self._collect(refs, time.perf_counter() + self.timeout_s, result, mismatches)
                )
        for key in ("transfer", "apply"):
            values = [a[key] for a in acks.values()]
            if values:
                result.timings[key] = max(values)
        result.timings.update(p.timings)
        result.timings["total"] = time.perf_counter() - p.t0
        self.timers.add("weights/transfer", result.timings.get("transfer", 0.0))
        self.timers.add("weights/apply", result.timings.get("apply", 0.0))
        if not mismatches and not p.prepared:
            # What the fault layer needs to re-sync a restarted worker to this version.
            self._last = (p.version, p.source, p.strict)
        if mismatches:
            no_model = sorted(r for r, e in mismatches.items() if isinstance(e, NoModelError))
            if no_model:
                exc: WeightMismatchError = NoModelError(
                    f"workers {no_model} of group {self.group.name} hold no model to receive "
                    f"weights: {mismatches[no_model[0]]}"
                )
            else:
                rank, err = sorted(mismatches.items())[0]
                exc = WeightMismatchError(f"worker {rank} of group {self.group.name}: {err}")
            exc.result = result  # type: ignore[attr-defined]
            raise exc
        return result

    def _collect(
        self,
        refs: dict[int, Any],
        deadline: float,
        result: SyncResult,
        mismatches: dict[int, BaseException],
    ) -> dict[int, dict[str, Any]]:
        acks: dict[int, dict[str, Any]] = {}
        if not refs:
            return acks
        left = max(0.0, deadline - time.perf_counter())
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=left)
        ready_set = set(ready)
        for r, ref in refs.items():
            if ref not in ready_set:
                result.failed[r] = f"{_LATE} {self.timeout_s}s"
                continue
            try:
                ack = ray.get(ref, timeout=1.0)
            except RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
                if isinstance(cause, WeightMismatchError):
                    mismatches[r] = cause
                result.failed[r] = f"{type(cause).__name__}: {cause}"
                continue
            except (RayActorError, GetTimeoutError) as e:
                result.failed[r] = f"worker died: {type(e).__name__}"
                continue
            acks[r] = ack
            result.failed.pop(r, None)
            result.routes[r] = ack.get("route", result.routes.get(r, ""))
            if ack.get("missing"):
                result.missing[r] = list(ack["missing"])
            (result.applied if ack["status"] == "applied" else result.ignored).append(r)
        result.applied.sort()
        result.ignored.sort()
        return acks

    # -- fault tolerance ----------------------------------------------------------------
    def _restore(self, ranks: list[int]) -> None:
        """Re-send the latest version to ``ranks`` (called by the fault layer after restarts).

        Goes through the object store. For the collective transport, whose buckets are
        not kept, the weights are taken again from the last source (the model or the
        weights object given), so they are its current values.
        """
        self._shm_sender.forget(ranks)  # new processes: they view no buffer
        if self._pending is not None:
            self.wait_async()
        if self._prepared is not None and self._prepared[0] == self._version:
            self._restore_prepared(list(ranks))
            return
        if self._last is None:
            return
        version, source, strict = self._last
        last_os = self._transport_senders["object_store"].last
        if last_os is not None and last_os[0] == version:
            _, layout, payload = last_os
        else:
            layout, sources = gather(self._named(source), name_map=self.name_map, dtype=self.dtype)
            payload = self._put(version, layout, sources)
        self._resend(self._ranks(list(ranks)), "object_store", version, layout, payload, strict)

    def _restore_prepared(self, ranks: list[int]) -> None:
        version, replay, strict = self._prepared
        if replay is None:
            return  # a broadcast is not kept: the caller restores (e.g. llm.refit)
        transport, layout, payload, kept = replay
        ranks = self._ranks(ranks)
        if kept is not None and not self._shm_sender.owns(kept.path):
            # The ring retired that buffer (a receiver did not answer): send the bytes
            # the sender still maps through the object store instead.
            transport = "object_store"
            payload = self._put(version, layout, list(views(kept.tensor, layout).values()))
        self._resend(ranks, transport, version, layout, payload, strict, kept)

    def _resend(
        self,
        ranks: list[int],
        transport: str,
        version: int,
        layout: Layout,
        payload: Any,
        strict: bool,
        kept: Any = None,
    ) -> None:
        """Apply ``version`` again on (restarted) ``ranks``; RuntimeError if some failed."""
        refs = {
            r: self._apply_remote(r, transport, version, layout, payload, strict) for r in ranks
        }
        result = SyncResult(version, transport=transport, routes=dict.fromkeys(ranks, transport))
        acks = self._collect(refs, time.perf_counter() + self.timeout_s, result, {})
        if kept is not None and transport == "shm":
            holds = {r: a.get("holds") for r, a in acks.items()}
            self._shm_sender.settle(kept.path, holds, list(result.failed))
        if result.failed:
            raise RuntimeError(
                f"weights restore to ranks {sorted(result.failed)} failed: {result.failed}"
            )

    @staticmethod
    def _cleanup(state: dict[str, Any], remove_hook: Any) -> None:
        remove_hook()
        for half in state.get("_transport_senders", {}).values():
            half.close()
        _shm_files.reap_orphans()
        state["_prepared"] = None


class _RestoreHook:
    """The group's restart hook for one sender, holding it weakly."""

    def __init__(self, ref: weakref.ref):
        self._ref = ref

    def __call__(self, ranks: list[int]) -> None:
        sender = self._ref()
        if sender is not None:
            sender._restore(ranks)


class RayModuleTransformSender(WeightSender):
    """A sender for the one actor that hosts a module (TorchRL's ``RayModuleTransformSender``).

    ``target`` is a phalanx group (usually of one worker); ``worker_id`` picks the actor
    that hosts the module. ``send()`` with no ``worker_ids`` sends to that actor only.

    Args:
        target: the group holding the actor that hosts the module.
        model: as for ``WeightSender``.
        worker_id: the rank of that actor.
        **kwargs: ``WeightSender``'s keyword arguments.
    """

    def __init__(
        self,
        target: WorkerGroup,
        model: torch.nn.Module | None = None,
        *,
        worker_id: int = 0,
        **kwargs: Any,
    ):
        super().__init__(target, model, **kwargs)
        self.worker_id = self._ranks(worker_id)[0]

    def _start(
        self, weights: Any, worker_ids: Any, snapshot: bool, strict: bool | None = None
    ) -> Delivery:
        return super()._start(
            weights, self.worker_id if worker_ids is None else worker_ids, snapshot, strict
        )

    def update_weights(self, weights: Any) -> SyncResult:
        """Send ``weights`` to the actor that hosts the module and wait until applied.

        Args:
            weights: as for ``send``.

        Returns:
            The ``SyncResult``.
        """
        return self.send(weights)


def _physical_gpu(device: torch.device) -> str:
    """The node-level id of a CUDA device (``CUDA_VISIBLE_DEVICES`` maps local indices)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return visible.split(",")[index].strip()
    return str(index)
