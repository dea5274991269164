"""The receiving side: validate a whole version, then apply it between method calls.

Any worker whose model is ``self.model`` (or who overrides ``weights_module()``) can
receive. The sender reaches it through the host's public side-call entry
(``WorkerHost.px_side_call``, which runs beside a busy method) with one of the ``*_op``
functions below. A payload is first made available locally by its transport (zero-copy
views of the object store or of shared memory, or a staging buffer filled by a
broadcast); then every name, shape and dtype is checked against the module; only if all
match is the version applied, under the worker's call lock
(``phalanx.worker.call_lock``), so a method call never sees half a version. Applying
means copying into the existing parameters, or, for a ``read_only_weights`` receiver
given one of the sender's shared buffers, pointing the parameters at that buffer (no
copy). Versions that are not newer are ignored. An idle worker receiving a broadcast
skips the staging copy (see ``transports/collective.py``).

A version that lacks some of the module's parameters is refused (``strict=True``, the
default) or applied as a partial version (``strict=False``: the ack lists the names it
did not carry, and so does ``worker.weights_missing``).
"""

from __future__ import annotations

import functools
import time
import weakref
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from phalanx.weights.targets import (
    NoModelError,
    WeightMismatchError,
    copy_into,
    module_of,
    target_tensors,
    validate,
)
from phalanx.weights.transports import collective, registry, shm
from phalanx.worker.call_lock import call_lock
from phalanx.worker.weights_state import WeightsReceiverMixin, receiver_state

if TYPE_CHECKING:
    from phalanx.weights.layout import Layout

__all__ = [
    "NoModelError",
    "WeightMismatchError",
    "WeightsReceiverMixin",
    "apply_weights",
    "validate",
]


def unshare(
    worker: Any,
    targets: dict[str, torch.Tensor] | None = None,
    overwritten: frozenset[str] = frozenset(),
) -> None:
    """Give a receiver whose parameters view a shared buffer private storage again.

    Call under the write lock (or from the method that is about to write), before
    anything writes into the parameters. Tensors named in ``overwritten`` (about to be
    written whole) get fresh storage without their old values.
    """
    state = receiver_state(worker)
    if state.view is None:
        return
    if targets is None:
        targets = target_tensors(module_of(worker))
    done: set[int] = set()
    for name, t in targets.items():
        if id(t) not in done:
            done.add(id(t))
            t.data = torch.empty_like(t.data) if name in overwritten else t.data.clone()
    state.view = None


def _record(worker: Any, version: int | None, missing: tuple[str, ...]) -> None:
    if version is not None:
        state = receiver_state(worker)
        state.version = version
        state.torn = 0
        state.missing = missing


def apply_weights(
    obj: Any,
    layout: Layout,
    sources: dict[str, torch.Tensor],
    version: int | None = None,
    lock: Any = None,
    timeout: float | None = None,
    strict: bool = False,
) -> bool:
    """Copy a whole version into ``obj``'s module: all or nothing. False if not newer.

    ``sources`` maps each spec name to a tensor of the spec's shape and dtype, or to the
    list of uint8 pieces that hold its bytes (a tensor split across buckets). ``lock`` is
    a ``ReadWriteLock``: the copy happens under its write side.
    """
    state = receiver_state(obj)
    if version is not None and version <= state.version:
        return False
    targets = target_tensors(module_of(obj))
    missing = validate(targets, layout, strict)
    ctx = lock.write(timeout) if lock is not None else nullcontext()
    with ctx:
        if version is not None and version <= state.version:
            return False
        carried = frozenset(s.name for s in layout.specs)
        unshare(obj, targets, carried)
        copy_into(targets, layout, sources)
        _record(obj, version, missing)
    return True


def adopt_views(
    obj: Any,
    layout: Layout,
    sources: dict[str, torch.Tensor],
    version: int,
    buffer: str,
    lock: Any,
    timeout: float | None,
    strict: bool,
) -> bool:
    """Point ``obj``'s parameters at ``sources`` (views of shared ``buffer``): no copy.

    All or nothing, under the write lock, between method calls. Tensors the version does
    not carry (a partial version) get private storage if they viewed an older buffer.
    """
    state = receiver_state(obj)
    if version <= state.version:
        return False
    targets = target_tensors(module_of(obj))
    missing = validate(targets, layout, strict)
    with lock.write(timeout):
        if version <= state.version:
            return False
        with torch.no_grad():
            if state.view is not None:
                for name in missing:
                    targets[name].data = targets[name].data.clone()
            for spec in layout.specs:
                targets[spec.name].data = sources[spec.name]
            for alias, canon in layout.aliases.items():
                targets[alias].data = sources[canon]
        state.view = buffer
        _record(obj, version, missing)
    _guard_loads(obj, module_of(obj))
    return True


def _guard_loads(worker: Any, module: Any) -> None:
    """Make ``load_state_dict`` on ``module`` (or any submodule) unshare first: the shared
    buffers are mapped read-only, and the receiver's own load must not write into them."""
    if not isinstance(module, torch.nn.Module):
        return
    guarded = receiver_state(worker).scratch.setdefault("guarded", weakref.WeakSet())
    ref = weakref.ref(worker)
    for m in module.modules():
        if m not in guarded:
            guarded.add(m)
            m.register_load_state_dict_pre_hook(functools.partial(_unshare_before_load, ref))


def _unshare_before_load(ref: weakref.ref, *_: Any) -> None:
    worker = ref()
    if worker is not None:
        unshare(worker)


def can_view(obj: Any) -> bool:
    """True when ``obj`` may take shared buffers as its parameters (read-only, on CPU)."""
    if not receiver_state(obj).read_only:
        return False
    try:
        targets = target_tensors(module_of(obj))
    except (TypeError, WeightMismatchError):
        return False
    return all(t.device.type == "cpu" for t in targets.values())


# -- operations the sender runs on a worker (through WorkerHost.px_side_call) -------------


def version_op(worker: Any) -> int:
    """The version ``worker`` holds."""
    return receiver_state(worker).version


collective_join_op = collective.join  # run on a worker: join the sender's weights group


def _span(worker: Any, tag: str) -> Any:
    timer = getattr(worker, "worker_timer", None)
    return timer(tag) if callable(timer) else nullcontext()


def apply_op(
    worker: Any,
    transport: str,
    version: int,
    layout: Layout,
    payload: Any,
    timeout: float | None,
    strict: bool = True,
) -> dict[str, Any]:
    """Receive ``version`` through ``transport`` and apply it; the ack for the sender."""
    state = receiver_state(worker)
    stale = version <= state.version
    lock = call_lock(worker)
    t0 = time.perf_counter()
    if transport == "collective" and not stale:
        with _span(worker, "weights/transfer"):
            status = collective.apply_in_place(worker, version, layout, payload, lock, strict)
        if status is not None:  # received and applied in one pass
            return _ack(worker, status, "collective", t0, time.perf_counter())
    if transport == "shm" and not stale and payload.get("ring") and can_view(worker):
        shm.forget_retired(worker, payload.get("retired", ()))
        with _span(worker, "weights/transfer"):
            sources = shm.open_views(worker, payload["path"], layout)
        t1 = time.perf_counter()
        with _span(worker, "weights/apply"):
            ok = adopt_views(
                worker, layout, sources, version, payload["path"], lock, timeout, strict
            )
        return _ack(worker, "applied" if ok else "ignored", "shm_view", t0, t1)
    with _span(worker, "weights/transfer"):
        # A stale version still takes part in a collective (others depend on it).
        sources, release = registry.receive(worker, transport, layout, payload, skip=stale)
    t1 = time.perf_counter()
    try:
        if stale:
            applied = False
        else:
            with _span(worker, "weights/apply"):
                applied = apply_weights(worker, layout, sources, version, lock, timeout, strict)
    finally:
        release()
    return _ack(worker, "applied" if applied else "ignored", transport, t0, t1)


def _ack(worker: Any, status: str, route: str, t0: float, t1: float) -> dict[str, Any]:
    state = receiver_state(worker)
    t2 = time.perf_counter()
    return {
        "status": status,
        "version": state.version,
        "route": route,
        "holds": state.view,  # the shared buffer this worker's parameters view, if any
        "missing": list(state.missing),
        "transfer": t1 - t0,
        "apply": t2 - t1,
    }
