"""A policy rank's training state kept in memory-mapped files, for in-place recovery.

After each training step every rank copies its shards of the trainable weights, the
optimizer's state and the scheduler's state into files of its own (in ``/dev/shm`` on the
driver's node, or a folder of the run), which outlive the process: a relaunched rank maps
them and copies them back. The files are laid out once and stay mapped, so keeping the
state is one multi-tensor copy of its bytes; a checkpoint (``torch.distributed.checkpoint``)
serialises every tensor into new files instead. The caller alternates two slots, so a rank
that dies while writing one leaves the other, the last good state, whole.
"""

from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64  # bytes: every tensor starts aligned for any dtype's view

__all__ = ["KeptState", "StateLayoutError"]


class StateLayoutError(RuntimeError):
    """The kept state does not fit this rank's model and optimizer (another model, world
    size or optimizer): names the first entry that differs."""


@dataclass(frozen=True)
class _Entry:
    path: str  # "model/<name>", "optim/state/<name>/exp_avg", ...
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Leaf:
    """Where a tensor stood in the state's tree: its index among the tensors."""

    index: int


def _flatten(tree: Any, path: str, out: list[tuple[str, Any]]) -> Any:
    """``tree`` with each tensor replaced by a ``_Leaf`` and appended to ``out`` as
    ``(path, tensor)``, in the tree's own order."""
    if isinstance(tree, torch.Tensor):
        out.append((path, tree))
        return _Leaf(len(out) - 1)
    if isinstance(tree, dict):
        return {k: _flatten(v, f"{path}/{k}", out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_flatten(v, f"{path}/{i}", out) for i, v in enumerate(tree)]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _fill(skeleton: Any, tensors: list[Any]) -> Any:
    """The tree of ``skeleton`` with each ``_Leaf`` replaced by its tensor."""
    if isinstance(skeleton, _Leaf):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: _fill(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        items = [_fill(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _layout(tensors: list[tuple[str, Any]]) -> tuple[list[_Entry], int]:
    entries, offset = [], 0
    for path, t in tensors:
        local = _local(t)
        entry = _Entry(path, tuple(local.shape), local.dtype, offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def _views(flat: torch.Tensor, entries: list[_Entry]) -> list[torch.Tensor]:
    return [flat[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in entries]


class KeptState:
    """One rank's kept training state: ``keep`` copies a model's, optimizer's and
    scheduler's state into slot files under ``root``, ``restore`` copies a slot back into
    (freshly built) ones. The mapped files are reused from one keep to the next.

    The model's frozen parameters (a LoRA run's base weights) are not kept: a relaunched
    rank loads them as it starts."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._maps: dict[str, tuple[list[_Entry], torch.Tensor]] = {}  # data file -> mapping

    def _files(self, root: str, slot: int) -> tuple[str, str]:
        if slot not in (0, 1):
            raise ValueError(f"slot must be 0 or 1, got {slot!r}")
        base = os.path.join(root, f"rank{self.rank}-slot{slot}")
        return base + ".state", base + ".meta"

    @staticmethod
    def _state(model: torch.nn.Module, optimizer: Any, scheduler: Any) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        if optimizer is None:
            raise RuntimeError("keep_state: no optimizer (init_optimizer=False)")
        opts = StateDictOptions(ignore_frozen_params=True)
        return {
            "model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, optimizer, options=opts),
            "scheduler": scheduler.state_dict() if scheduler is not None else {},
        }

    def _mapping(self, data: str, entries: list[_Entry], size: int) -> torch.Tensor:
        """The mapped data file, created (or resized) when its layout is new."""
        known = self._maps.get(data)
        if known is not None and known[0] == entries:
            return known[1]
        if not os.path.exists(data) or os.path.getsize(data) != size:
            with open(data, "wb") as f:
                f.truncate(size)
        flat = torch.from_file(data, shared=True, size=size, dtype=torch.uint8)
        self._maps[data] = (entries, flat)
        return flat

    @torch.no_grad()
    def keep(
        self, root: str, slot: int, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> int:
        """Copy this rank's state into ``slot`` under ``root``; the bytes kept.

        Raises:
            ValueError: ``slot`` is not 0 or 1.
            OSError: the files could not be written (``root`` missing, a full disk).
        """
        data, meta = self._files(root, slot)
        tensors: list[tuple[str, Any]] = []
        skeleton = _flatten(self._state(model, optimizer, scheduler), "", tensors)
        entries, size = _layout(tensors)
        flat = self._mapping(data, entries, size)
        torch._foreach_copy_(_views(flat, entries), [_local(t) for _, t in tensors])
        with open(meta + ".tmp", "wb") as f:
            pickle.dump({"entries": entries, "skeleton": skeleton, "size": size}, f)
        os.replace(meta + ".tmp", meta)
        return size

    @torch.no_grad()
    def restore(
        self, root: str, slot: int, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> None:
        """Load ``slot`` under ``root`` (written by this rank's predecessor) into the model,
        the optimizer and the scheduler.

        Raises:
            FileNotFoundError: nothing was kept in that slot.
            StateLayoutError: the kept state has other entries, shapes or dtypes.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        data, meta = self._files(root, slot)
        with open(meta, "rb") as f:
            kept = pickle.load(f)
        tensors: list[tuple[str, Any]] = []
        _flatten(self._state(model, optimizer, scheduler), "", tensors)
        entries, size = _layout(tensors)
        want = [(e.path, e.shape, e.dtype) for e in kept["entries"]]
        here = [(e.path, e.shape, e.dtype) for e in entries]
        if want != here:
            first = next((i for i, (w, h) in enumerate(zip(want, here)) if w != h), None)
            detail = (
                f"kept {want[first]}, here {here[first]}"
                if first is not None
                else f"kept {len(want)} tensors, here {len(here)}"
            )
            raise StateLayoutError(
                f"rank {self.rank}: the state kept in {data} does not fit this model and "
                f"optimizer: {detail}"
            )
        flat = self._mapping(data, entries, size)
        torch._foreach_copy_([_local(t) for _, t in tensors], _views(flat, entries))
        state = _fill(kept["skeleton"], [t for _, t in tensors])
        opts = StateDictOptions(ignore_frozen_params=True, strict=False)
        set_model_state_dict(model, state["model"], options=opts)
        set_optimizer_state_dict(model, optimizer, state["optim"], options=opts)
        if scheduler is not None and state["scheduler"]:
            scheduler.load_state_dict(state["scheduler"])

    def close(self) -> None:
        """Unmap the files (they stay on disk for a successor; the caller removes them)."""
        self._maps = {}
