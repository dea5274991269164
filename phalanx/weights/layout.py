"""Weights as a flat byte stream: gather named tensors, plan their layout, pack, unpack.

Every transport moves the same thing: the bytes of each tensor (after an optional dtype
cast) laid end to end, each tensor starting at a 64-byte aligned offset. Dtypes without
a numpy equivalent (bf16, fp8) travel as raw bytes and are reinterpreted on arrival.
A fixed-size bucket is a byte range of that stream, so a tensor larger than a bucket
simply spans several buckets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

ALIGN = 64

NameMap = Callable[[str], "str | None"] | Mapping[str, "str | None"]


class TensorSpec(NamedTuple):
    """Where one tensor lives in the stream, and what it is (immutable; a tuple, so a
    layout of a few hundred specs is built and compared quickly)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_dtype(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Layout:
    """The specs of a payload, its total size, and tied names (alias -> canonical name)."""

    specs: list[TensorSpec]
    total_bytes: int
    aliases: dict[str, str] = field(default_factory=dict)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Pickled as columns: a refit's handle carries the layout every refit, and one
        # pickled object per spec costs about ten times as much to send and rebuild.
        columns = tuple(zip(*((s.name, s.shape, s.dtype, s.offset, s.nbytes) for s in self.specs)))
        return _from_columns, (columns, self.total_bytes, self.aliases)

    def buckets(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` of fixed-size buckets covering the stream."""
        return [
            (s, min(s + bucket_bytes, self.total_bytes))
            for s in range(0, self.total_bytes, bucket_bytes)
        ]


def _from_columns(columns: tuple[Any, ...], total_bytes: int, aliases: dict[str, str]) -> Layout:
    """The ``Layout`` that ``Layout.__reduce__`` pickled."""
    return Layout(list(map(TensorSpec._make, zip(*columns))), total_bytes, aliases)


@functools.cache
def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _flatten(prefix: str, value: Any, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        raise TypeError(f"weights: entry {prefix!r} is a {type(value).__name__}, expected a tensor")


def to_named_tensors(weights: Any) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` (no copies) from an ``nn.Module``, a dict of tensors or a TensorDict."""
    if isinstance(weights, torch.nn.Module):
        return dict(weights.state_dict())
    try:
        from tensordict import TensorDictBase
    except ImportError:  # pragma: no cover - tensordict is a dependency
        TensorDictBase = ()  # type: ignore[assignment]
    if isinstance(weights, TensorDictBase):
        return {
            ".".join(k) if isinstance(k, tuple) else k: v
            for k, v in weights.items(include_nested=True, leaves_only=True)
        }
    if isinstance(weights, Mapping):
        out: dict[str, torch.Tensor] = {}
        _flatten("", weights, out)
        return out
    raise TypeError(
        "weights must be None, an nn.Module, a dict of tensors or a TensorDict, "
        f"got {type(weights).__name__}"
    )


def check_name_map(name_map: Any) -> None:
    if name_map is not None and not callable(name_map) and not isinstance(name_map, Mapping):
        raise TypeError(
            f"name_map must be None, a callable or a dict, got {type(name_map).__name__}"
        )


def check_dtype(dtype: Any) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be None or a torch.dtype, got {dtype!r}")


def gather(
    named: Mapping[str, torch.Tensor],
    *,
    name_map: NameMap | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Layout, list[torch.Tensor]]:
    """Plan the stream for ``named`` after renaming and casting; returns (layout, sources).

    No data is copied: sources are the given tensors (detached). A name mapped to None is
    dropped. Only floating-point tensors are cast to ``dtype``. Tensors that share storage
    under several names (tied weights) are sent once.
    """
    specs: list[TensorSpec] = []
    sources: list[torch.Tensor] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    offset = 0
    for name, t in named.items():
        if name_map is not None:
            new = name_map.get(name, name) if isinstance(name_map, Mapping) else name_map(name)
            if new is None:
                continue
            if not isinstance(new, str):
                raise TypeError(f"name_map({name!r}) returned {new!r}, expected a str or None")
            name = new
        t = t.detach()
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        nbytes = t.numel() * out_dtype.itemsize
        specs.append(TensorSpec(name, tuple(t.shape), _dtype_name(out_dtype), offset, nbytes))
        sources.append(t)
        offset += -(-nbytes // ALIGN) * ALIGN
    names = [s.name for s in specs] + list(aliases)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"name_map maps several parameters to the same names {dup}")
    return Layout(specs, offset, aliases), sources


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def pack_range(
    dst: torch.Tensor, layout: Layout, sources: list[torch.Tensor], start: int, end: int
) -> None:
    """Copy stream bytes ``[start, end)`` into the uint8 tensor ``dst`` (casting on the way),
    as one multi-tensor copy."""
    outs: list[torch.Tensor] = []
    ins: list[torch.Tensor] = []
    for spec, src in zip(layout.specs, sources):
        lo, hi = max(start, spec.offset), min(end, spec.offset + spec.nbytes)
        if lo >= hi:
            continue
        dt = spec.torch_dtype
        size = dt.itemsize
        e0, e1 = (lo - spec.offset) // size, (hi - spec.offset) // size
        out = dst[lo - start : hi - start].view(dt)
        if lo == spec.offset and hi == spec.offset + spec.nbytes:
            out, part = out.view(src.shape), src  # whole: no flattening copy of a strided src
        else:
            part = _flat(src)[e0:e1]
        if part.device != out.device and part.dtype != dt:
            part = part.to(dt)  # cast on the source device, then move
        outs.append(out)
        ins.append(part)
    if outs:
        torch._foreach_copy_(outs, ins)


def unpack_range(
    src: torch.Tensor, layout: Layout, targets: list[torch.Tensor], start: int, end: int
) -> None:
    """Copy stream bytes ``[start, end)`` from the uint8 tensor ``src`` into ``targets``
    (contiguous, one per spec, of the spec's dtype): the inverse of ``pack_range``."""
    for spec, dst in zip(layout.specs, targets):
        lo, hi = max(start, spec.offset), min(end, spec.offset + spec.nbytes)
        if lo < hi:
            as_bytes(dst)[lo - spec.offset : hi - spec.offset].copy_(src[lo - start : hi - start])


def views(flat: torch.Tensor, layout: Layout, base: int = 0) -> dict[str, torch.Tensor]:
    """Typed, shaped views of each tensor inside the uint8 stream ``flat`` (which starts at ``base``)."""
    out = {}
    for spec in layout.specs:
        lo = spec.offset - base
        out[spec.name] = flat[lo : lo + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The contiguous uint8 view of a tensor's data (a copy only if it is not contiguous)."""
    return _flat(t).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def check_sizes(bucket_size_mb: Any) -> int:
    """Bytes of a bucket from ``bucket_size_mb`` (rounded to the alignment)."""
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)):
        raise TypeError(f"bucket_size_mb must be a number, got {type(bucket_size_mb).__name__}")
    if bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    return max(ALIGN, int(bucket_size_mb * (1 << 20)) // ALIGN * ALIGN)


def unique(items: Iterable[int]) -> list[int]:
    return list(dict.fromkeys(items))


def pack_state_dict(
    weights: Any,
    *,
    dtype: torch.dtype | None = None,
    name_map: NameMap | None = None,
    out: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> tuple[Layout, torch.Tensor]:
    """Pack a module / dict / TensorDict into one uint8 stream; returns (layout, stream).

    ``out`` (a uint8 tensor at least ``layout.total_bytes`` long, e.g. a ``ShmSegment``'s
    tensor) is filled instead of allocating. ``views(stream, layout)`` gives the tensors back.
    """
    check_dtype(dtype)
    check_name_map(name_map)
    layout, sources = gather(to_named_tensors(weights), name_map=name_map, dtype=dtype)
    if out is None:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.numel() < layout.total_bytes:
        raise ValueError(
            f"out must be a uint8 tensor of at least {layout.total_bytes} bytes, got "
            f"{out.dtype} of {out.numel()}"
        )
    pack_range(out[: layout.total_bytes], layout, sources, 0, layout.total_bytes)
    return layout, out[: layout.total_bytes]


def check_finite(layout: Layout, sources: list[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the first floating-point tensor holding NaN or Inf.

    One reduction per tensor (a sum is NaN/Inf when any element is); only a tensor whose
    sum is not finite is checked element by element, since a sum of large finite values
    may overflow.
    """
    for spec, t in zip(layout.specs, sources):
        if not t.is_floating_point() or t.numel() == 0:
            continue
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        if bool(torch.isfinite(t.sum(dtype=acc))):
            continue
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            n = int(bad.sum())
            raise ValueError(
                f"weights: {spec.name!r} holds {n} NaN/Inf value(s) of {t.numel()}; nothing was "
                "sent (pass allow_nonfinite=True to send them anyway)"
            )
