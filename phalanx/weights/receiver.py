"""The receiving side: validate a whole version, then copy it in place between calls.

Any worker whose model is ``self.model`` (or who overrides ``weights_module()``) can
receive. A payload is first made available locally by its transport (zero-copy views of
the object store or of shared memory, or a staging buffer filled by a broadcast); then
every name, shape and dtype is checked against the module; only if all match are the
bytes copied into the existing parameters and buffers, under the host's write lock, so
a method call never sees half a version. Versions that are not newer are ignored. An
idle worker receiving a broadcast skips the staging copy: it validates first, then
receives straight into its parameters under the write lock (see
``transports/collective.py`` for what happens when such a transfer breaks midway).

Torch is imported lazily: the mixin is part of every ``Worker``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from phalanx.weights.layout import Layout


class WeightMismatchError(ValueError):
    """Sent weights do not fit the receiver's module; nothing was changed."""


class WeightsReceiverMixin:
    """Receiver side of weight sync, part of every ``px.Worker``."""

    _px_weights_version: int = 0
    _px_weights_torn: int = 0  # a version whose in-place transfer broke midway (0: none)

    @property
    def weights_version(self) -> int:
        """The version of the weights applied last (0: none received yet)."""
        return self._px_weights_version

    @property
    def weights_torn(self) -> int:
        """A version whose in-place (collective) transfer broke midway, leaving the model
        a mix of two versions until a whole version is applied again; 0 when consistent."""
        return self._px_weights_torn

    def weights_module(self) -> Any:
        """The ``torch.nn.Module`` that receives weights; ``self.model`` unless overridden."""
        model = getattr(self, "model", None)
        if model is None:
            raise AttributeError(
                f"{type(self).__name__} has no model to receive weights: set self.model "
                "or override weights_module()"
            )
        return model


def _module_of(obj: Any) -> Any:
    fn = getattr(obj, "weights_module", None)
    module = fn() if callable(fn) else getattr(obj, "model", None)
    if module is None:
        raise AttributeError(
            f"{type(obj).__name__} has no model to receive weights: set self.model "
            "or define weights_module()"
        )
    return module


def target_tensors(module: Any) -> dict[str, torch.Tensor]:
    """Parameters and buffers by state-dict name (the tensors themselves, not copies)."""
    import torch

    if isinstance(module, torch.nn.Module):
        return dict(module.state_dict(keep_vars=True))
    if isinstance(module, dict):
        return dict(module)
    raise TypeError(f"weights_module() must return an nn.Module, got {type(module).__name__}")


def validate(targets: dict[str, torch.Tensor], layout: Layout) -> None:
    """Raise ``WeightMismatchError`` naming the first parameter that does not fit."""
    for spec in layout.specs:
        t = targets.get(spec.name)
        if t is None:
            raise WeightMismatchError(
                f"unknown parameter {spec.name!r} (sent shape {list(spec.shape)}): the "
                f"receiver's module has no such parameter or buffer"
            )
        if tuple(t.shape) != spec.shape:
            raise WeightMismatchError(
                f"parameter {spec.name!r}: shape mismatch, receiver has {list(t.shape)}, "
                f"sent {list(spec.shape)}"
            )
        if t.dtype != spec.torch_dtype:
            raise WeightMismatchError(
                f"parameter {spec.name!r}: dtype mismatch, receiver has "
                f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}, sent {spec.dtype} "
                f"{list(spec.shape)}"
            )
    specs = {s.name: s for s in layout.specs}
    for alias, canon in layout.aliases.items():
        t, spec = targets.get(alias), specs[canon]
        if t is None or tuple(t.shape) != spec.shape or t.dtype != spec.torch_dtype:
            have = "missing" if t is None else f"{list(t.shape)} {t.dtype}"
            raise WeightMismatchError(
                f"parameter {alias!r} (tied to {canon!r}): receiver has {have}, sent "
                f"{list(spec.shape)} {spec.dtype}"
            )


def copy_into(
    targets: dict[str, torch.Tensor], layout: Layout, sources: dict[str, torch.Tensor]
) -> None:
    """Copy every source into its target in place (after ``validate``)."""
    import torch

    with torch.no_grad():
        for spec in layout.specs:
            src = sources[spec.name]
            if isinstance(src, list):
                _copy_pieces(targets[spec.name], spec.torch_dtype, src)
            else:
                targets[spec.name].copy_(src)
        copy_aliases(targets, layout)


def _copy_pieces(dst: torch.Tensor, dtype: torch.dtype, pieces: list[torch.Tensor]) -> None:
    """Copy uint8 pieces that together hold ``dst``'s bytes into it, each piece once."""
    import torch

    if not dst.is_contiguous():
        dst.copy_(torch.cat(pieces).view(dtype).view(dst.shape))
        return
    flat = dst.detach().reshape(-1).view(torch.uint8)
    at = 0
    for piece in pieces:
        flat[at : at + piece.numel()].copy_(piece)
        at += piece.numel()


def copy_aliases(targets: dict[str, torch.Tensor], layout: Layout) -> None:
    """Tied names whose receiver tensor is not shared with their canonical one get a copy."""
    for alias, canon in layout.aliases.items():
        dst = targets[alias]
        if dst.data_ptr() != targets[canon].data_ptr():
            dst.copy_(targets[canon])


def apply_weights(
    obj: Any,
    layout: Layout,
    sources: dict[str, torch.Tensor],
    version: int | None = None,
    lock: Any = None,
    timeout: float | None = None,
) -> bool:
    """Apply a whole version to ``obj``'s module: all or nothing. False if not newer.

    ``sources`` maps each spec name to a tensor of the spec's shape and dtype, or to the
    list of uint8 pieces that hold its bytes (a tensor split across buckets). ``lock`` is
    a ``ReadWriteLock``: the copy happens under its write side.
    """
    if version is not None and version <= getattr(obj, "_px_weights_version", 0):
        return False
    targets = target_tensors(_module_of(obj))
    validate(targets, layout)
    ctx = lock.write(timeout) if lock is not None else _null()
    with ctx:
        if version is not None and version <= getattr(obj, "_px_weights_version", 0):
            return False
        copy_into(targets, layout, sources)
        if version is not None:
            obj._px_weights_version = version
            obj._px_weights_torn = 0
    return True


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# -- the host's entry point ---------------------------------------------------------------


def handle(host: Any, op: str, *args: Any) -> Any:
    """Run one weights operation on a worker host (``WorkerHost._px_weights``)."""
    obj = host._obj
    if op == "version":
        return getattr(obj, "_px_weights_version", 0)
    if op == "validate":
        (layout,) = args
        validate(target_tensors(_module_of(obj)), layout)
        return True
    if op == "apply":
        transport, version, layout, payload, timeout = args
        return _receive_and_apply(host, transport, version, layout, payload, timeout)
    if op in ("collective_join", "collective_drop"):
        from phalanx.weights.transports import collective

        return getattr(collective, op.removeprefix("collective_"))(host, *args)
    raise ValueError(f"unknown weights operation {op!r}")


def _receive_and_apply(
    host: Any, transport: str, version: int, layout: Layout, payload: Any, timeout: float | None
) -> dict[str, Any]:
    from phalanx.weights.lock import model_lock
    from phalanx.weights.transports import receive

    obj = host._obj
    timers = host._timers
    stale = version <= getattr(obj, "_px_weights_version", 0)
    t0 = time.perf_counter()
    if transport == "collective" and not stale:
        from phalanx.weights.transports.collective import apply_in_place

        with timers.span("weights/transfer"):
            status = apply_in_place(host, version, layout, payload, model_lock(host))
        if status is not None:  # received and applied in one pass
            return {
                "status": status,
                "version": obj._px_weights_version,
                "transfer": time.perf_counter() - t0,
                "apply": 0.0,
            }
    with timers.span("weights/transfer"):
        # A stale version still takes part in a collective (others depend on it).
        sources, release = receive(host, transport, layout, payload, skip=stale)
    t1 = time.perf_counter()
    try:
        if stale:
            applied = False
        else:
            with timers.span("weights/apply"):
                applied = apply_weights(obj, layout, sources, version, model_lock(host), timeout)
    finally:
        release()
    t2 = time.perf_counter()
    return {
        "status": "applied" if applied else "ignored",
        "version": getattr(obj, "_px_weights_version", 0),
        "transfer": t1 - t0,
        "apply": t2 - t1,
    }
