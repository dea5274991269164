"""Column operations of a ``BatchedDataDict``: a column is a tensor or array batched along
dim 0, or a per-sample sequence (list, tuple). Rows are measured, taken, sliced and
concatenated here the same way for every kind."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from phalanx._base.checks import check_int

__all__ = ["batch_len", "concat", "index_list", "is_sequence", "slice_rows", "take"]


def is_sequence(value: Any) -> bool:
    """True for per-sample sequences (lists, tuples, ...), False for strings and bytes."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def batch_len(key: Any, value: Any) -> int:
    """Length of ``value`` along the batch dimension."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise ValueError(f"key {key!r} holds a 0-d array; batched values need a batch dim")
        return int(value.shape[0])
    if is_sequence(value):
        return len(value)
    raise TypeError(
        f"key {key!r} holds a {type(value).__name__}; values must be tensors, arrays or "
        "per-sample sequences"
    )


def take(value: Any, indices: list[int]) -> Any:
    """Rows ``indices`` of ``value`` as a new object (fresh storage for tensors)."""
    if isinstance(value, torch.Tensor):
        index = torch.as_tensor(indices, dtype=torch.long, device=value.device)
        return value.index_select(0, index)
    if isinstance(value, np.ndarray):
        return value[np.asarray(indices, dtype=np.intp)]
    return [value[i] for i in indices]


def slice_rows(value: Any, start: int, end: int) -> Any:
    """Rows ``start:end`` of ``value`` (a view for tensors and arrays)."""
    if isinstance(value, (torch.Tensor, np.ndarray, list)):
        return value[start:end]
    return list(value[start:end])


def _pad_trailing(value: Any, target: list[int], pad_value: float) -> Any:
    """Right-pad every non-batch dim of ``value`` up to ``target``."""
    widths = [t - s for t, s in zip(target, value.shape[1:])]
    if not any(widths):
        return value
    if isinstance(value, np.ndarray):
        return np.pad(value, [(0, 0)] + [(0, w) for w in widths], constant_values=pad_value)
    spec: list[int] = []
    for width in reversed(widths):  # F.pad lists the last dimension first
        spec += [0, width]
    return F.pad(value, spec, value=pad_value)


def concat(key: Any, values: list[Any], pad_value: float) -> Any:
    """Concatenate one key's values from several batches along dim 0, padding if needed."""
    if all(isinstance(v, (torch.Tensor, np.ndarray)) for v in values):
        kinds = {type(v) is np.ndarray for v in values}
        ndims = {v.ndim for v in values}
        if len(kinds) > 1:
            raise TypeError(f"batches: key {key!r} mixes torch tensors and numpy arrays")
        if len(ndims) > 1 or 0 in ndims:
            raise ValueError(
                f"batches: key {key!r} needs tensors with the same number (>= 1) of dims, "
                f"got {sorted(ndims)}"
            )
        ndim = ndims.pop()
        target = [max(int(v.shape[d]) for v in values) for d in range(1, ndim)]
        padded = [_pad_trailing(v, target, pad_value) for v in values]
        if isinstance(padded[0], np.ndarray):
            return np.concatenate(padded, axis=0)
        return torch.cat(padded, dim=0)
    if all(is_sequence(v) for v in values):
        return [item for v in values for item in v]
    kinds_text = sorted({type(v).__name__ for v in values})
    raise TypeError(
        f"batches: key {key!r} has values of types {kinds_text}; all batches must hold "
        "tensors, arrays, or per-sample sequences for the same key"
    )


def index_list(indices: Any, size: int, name: str) -> list[int]:
    """Validate integer row indices in ``[0, size)`` and return them as a list."""
    if isinstance(indices, (torch.Tensor, np.ndarray)):
        if indices.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
        if isinstance(indices, torch.Tensor):
            is_int = not (indices.dtype.is_floating_point or indices.dtype.is_complex)
            is_int = is_int and indices.dtype != torch.bool
        else:
            is_int = np.issubdtype(indices.dtype, np.integer)
        if not is_int and len(indices):
            raise TypeError(f"{name} must hold integers, got dtype {indices.dtype}")
        out = [int(i) for i in indices.tolist()]
    elif is_sequence(indices):
        out = [check_int(i, name) for i in indices]
    else:
        raise TypeError(f"{name} must be a list, tensor or array of ints, got {indices!r}")
    bad = [i for i in out if not 0 <= i < size]
    if bad:
        raise IndexError(f"{name} has indices {bad[:5]} outside [0, {size})")
    return out
