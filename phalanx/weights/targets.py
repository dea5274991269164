"""The receiving module's tensors and how a sent version is checked and copied into them.

Shared by the receiver (``receiver.py``) and the transports that receive in place
(``transports/collective.py``): the module that receives (``weights_module()`` or
``model``), its parameters and buffers by state-dict name, the check of a whole version
against them (names, shapes, dtypes, tied names, missing names) and the copy.

A module's tensors by name are read once and kept while they are still the module's: a
refit of a model of a few hundred tensors otherwise spends more time walking its state
dict than copying on a GPU. Changing a tensor's data (a training step, ``p.data = ...``)
keeps the tensor itself.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from phalanx.weights.layout import Layout

__all__ = [
    "NoModelError",
    "WeightMismatchError",
    "bindings_epoch",
    "copy_aliases",
    "copy_into",
    "module_of",
    "target_tensors",
    "validate",
]


class WeightMismatchError(ValueError):
    """Sent weights do not fit the receiver's module; nothing was changed."""


class NoModelError(WeightMismatchError):
    """The receiver holds no model to receive weights into."""


def module_of(worker: Any) -> Any:
    """The module that receives weights on ``worker`` (``weights_module()`` or ``model``)."""
    fn = getattr(worker, "weights_module", None)
    try:
        module = fn() if callable(fn) else getattr(worker, "model", None)
    except AttributeError as e:
        raise NoModelError(str(e)) from None
    if module is None:
        raise NoModelError(
            f"{type(worker).__name__} has no model to receive weights: set self.model "
            "or define weights_module()"
        )
    return module


_epoch = [0]
_epoch_hooks: list[Any] = []


def _bump(*_: Any) -> None:
    _epoch[0] += 1


def bindings_epoch() -> int:
    """A number that changes whenever any ``nn.Module`` of this process registers a
    parameter, buffer or submodule, by assignment or ``register_*`` (torch's global
    registration hooks, installed by the first call). Replacing one in place without
    registering it (``Module._apply`` does so for buffers, FSDP2 for its parameters) does
    not change it: ``target_tensors`` checks those itself."""
    if not _epoch_hooks:
        from torch.nn.modules import module as nn_module

        _epoch_hooks.extend(
            register(_bump)
            for register in (
                nn_module.register_module_parameter_registration_hook,
                nn_module.register_module_buffer_registration_hook,
                nn_module.register_module_module_registration_hook,
            )
        )
    return _epoch[0]


@dataclass(eq=False)
class _Kept:
    """A module's state-dict tensors as read at ``epoch``, and where each one lives."""

    epoch: int
    tensors: dict[str, torch.Tensor]
    # (owning module, weakly, attribute, tensor) per name; None where some name does not
    # lead to its tensor (a state-dict hook renamed it): then nothing is kept
    homes: list[tuple[weakref.ref[torch.nn.Module], str, torch.Tensor]] | None

    @classmethod
    def read(cls, module: torch.nn.Module, epoch: int) -> _Kept:
        tensors = dict(module.state_dict(keep_vars=True))
        homes: list[tuple[weakref.ref[torch.nn.Module], str, torch.Tensor]] | None = []
        for name, t in tensors.items():
            prefix, _, leaf = name.rpartition(".")
            try:
                owner = module.get_submodule(prefix)
            except AttributeError:
                homes = None
                break
            if getattr(owner, leaf, None) is not t:
                homes = None
                break
            homes.append((weakref.ref(owner), leaf, t))
        return cls(epoch, tensors, homes)

    def holds(self, epoch: int) -> bool:
        """True while nothing was registered since and every name leads to its tensor."""
        return (
            self.epoch == epoch
            and self.homes is not None
            and all(getattr(owner(), leaf, None) is t for owner, leaf, t in self.homes)
        )


_kept: weakref.WeakKeyDictionary[torch.nn.Module, _Kept] = weakref.WeakKeyDictionary()


def target_tensors(module: Any) -> dict[str, torch.Tensor]:
    """Parameters and buffers by state-dict name (the tensors themselves, not copies).

    For an ``nn.Module`` the state dict is read once and kept while no module registers a
    tensor or submodule (``bindings_epoch``) and each name still leads to the tensor kept
    for it (a check of one attribute per name, far cheaper than a state dict).
    """
    if isinstance(module, torch.nn.Module):
        epoch = bindings_epoch()
        kept = _kept.get(module)
        if kept is None or not kept.holds(epoch):
            kept = _Kept.read(module, epoch)
            if kept.homes is not None:
                _kept[module] = kept
        return dict(kept.tensors)
    if isinstance(module, dict):
        return dict(module)
    raise TypeError(f"weights_module() must return an nn.Module, got {type(module).__name__}")


def validate(
    targets: dict[str, torch.Tensor], layout: Layout, strict: bool = False
) -> tuple[str, ...]:
    """Raise ``WeightMismatchError`` naming the first parameter that does not fit.

    Returns the receiver's names the layout does not carry; with ``strict`` any such name
    is an error too.
    """
    for spec in layout.specs:
        t = targets.get(spec.name)
        if t is None:
            raise WeightMismatchError(
                f"unknown parameter {spec.name!r} (sent shape {list(spec.shape)}): the "
                f"receiver's module has no such parameter or buffer"
            )
        if t.shape != spec.shape:
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
    missing = tuple(sorted(set(targets) - set(specs) - set(layout.aliases)))
    if strict and missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightMismatchError(
            f"missing parameters {list(missing[:5])}{more}: the sent weights do not cover the "
            "receiver's module (send them all, or pass strict=False for a partial update)"
        )
    return missing


def copy_into(
    targets: dict[str, torch.Tensor], layout: Layout, sources: dict[str, torch.Tensor]
) -> None:
    """Copy every source into its target in place (after ``validate``); whole tensors in
    one multi-tensor copy."""
    with torch.no_grad():
        outs: list[torch.Tensor] = []
        ins: list[torch.Tensor] = []
        for spec in layout.specs:
            src = sources[spec.name]
            if isinstance(src, list):
                _copy_pieces(targets[spec.name], spec.torch_dtype, src)
            else:
                outs.append(targets[spec.name])
                ins.append(src)
        if outs:
            torch._foreach_copy_(outs, ins)
        copy_aliases(targets, layout)


def _copy_pieces(dst: torch.Tensor, dtype: torch.dtype, pieces: list[torch.Tensor]) -> None:
    """Copy uint8 pieces that together hold ``dst``'s bytes into it, each piece once."""
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
