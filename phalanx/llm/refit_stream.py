"""Write a sharded model straight into one shared weight stream, each rank its own rows.

A refit through shared memory needs the full weights in one stream (the weight-sync
layer's layout). Gathering them first (an all-gather per parameter, then a copy on one
rank) costs a collective per tensor and a full copy on a single core. FSDP2 shards each
parameter by contiguous rows (``Shard(0)``), so each rank can instead copy its own rows
to their final place in a same-node segment, all ranks in parallel, with no collective.
Parameters split some other way (e.g. tensor-parallel columns) are gathered with
``full_tensor()`` and written once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from phalanx.weights import Layout, gather


def stream_layout(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Layout:
    """The stream layout of the *full* tensors of ``state`` (tied entries sent once).

    Built from zero-memory stand-ins of the global shapes, so no rank gathers anything.
    """
    stand_ins: dict[int, torch.Tensor] = {}
    named = {}
    for name, t in state.items():
        if id(t) not in stand_ins:
            shape = tuple(t.shape)
            stand_ins[id(t)] = torch.empty((1,) * len(shape), dtype=t.dtype).expand(shape)
        named[name] = stand_ins[id(t)]
    layout, _ = gather(named, dtype=dtype)
    return layout


def _row_block(t: DTensor) -> tuple[int, bool] | None:
    """(first row, is this rank the writer) when ``t`` is split by whole rows, else None."""
    mesh, start, writer = t.device_mesh, 0, True
    shards = [d for d, p in enumerate(t.placements) if type(p) is Shard and p.dim == 0]
    for d, p in enumerate(t.placements):
        if d in shards[:1]:
            size = -(-t.shape[0] // mesh.size(d))  # torch.chunk's block size
            start = mesh.get_local_rank(d) * size
        elif isinstance(p, Replicate):
            writer = writer and mesh.get_local_rank(d) == 0
        else:
            return None
    if len(shards) > 1:
        return None
    return start, writer


def write_shards(
    dst: torch.Tensor, layout: Layout, state: Mapping[str, torch.Tensor], is_rank0: bool
) -> int:
    """Copy this rank's part of every tensor of ``state`` into the uint8 stream ``dst``.

    Every rank of the model's mesh must call it (tensors that are not split by rows are
    gathered collectively, in ``layout`` order). Returns the bytes this rank wrote.
    """
    written = 0
    for spec in layout.specs:
        t = state[spec.name]
        dtype = spec.torch_dtype
        if isinstance(t, DTensor):
            block = _row_block(t)
            if block is None:
                local, row0, write = t.full_tensor(), 0, is_rank0
            else:
                local, (row0, write) = t.to_local(), block
        else:
            local, row0, write = t, 0, is_rank0
        if not write or local.numel() == 0:
            continue
        row_bytes = (local[0].numel() if local.dim() else 1) * dtype.itemsize
        lo = spec.offset + row0 * row_bytes
        nbytes = local.numel() * dtype.itemsize
        with torch.no_grad():
            dst[lo : lo + nbytes].view(dtype).view(local.shape).copy_(local.detach())
        written += nbytes
    return written
