"""Packing a micro-batch of right-padded rows into one row, and unpacking the results.

A packed row holds the sequences back to back (each cut to its ``input_lengths``), with
position ids restarting at 0 for every sequence and a block-diagonal causal attention mask,
so no token attends across a sequence boundary: the model computes, for every sequence,
what it computes on that sequence alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRow:
    """One packed row: ``input_ids``/``position_ids`` [1, L], ``attention_mask`` [1, 1, L, L]
    (True where a query may attend), and where each sequence starts and how long it is."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    starts: list[int]
    lengths: list[int]


def pack_rows(
    input_ids: torch.Tensor, lengths: torch.Tensor, pad_id: int, pad_to_multiple: int = 1
) -> PackedRow:
    """Pack rows ``input_ids`` [B, T] of ``lengths`` [B]; the row is right-padded with
    ``pad_id`` to a multiple of ``pad_to_multiple`` (the pad tail is its own segment)."""
    B, T = input_ids.shape
    lens = [int(n) for n in lengths.tolist()]
    bad = [n for n in lens if not 0 <= n <= T]
    if bad:
        raise ValueError(f"input_lengths {bad[:5]} outside [0, {T}] (sequence length {T})")
    dev = input_ids.device
    starts, pieces, positions, segments = [], [], [], []
    at = 0
    for i, n in enumerate(lens):
        starts.append(at)
        pieces.append(input_ids[i, :n])
        positions.append(torch.arange(n, device=dev))
        segments.append(torch.full((n,), i, device=dev))
        at += n
    pad = -at % pad_to_multiple if at else pad_to_multiple
    if pad:
        pieces.append(input_ids.new_full((pad,), pad_id))
        positions.append(torch.arange(pad, device=dev))
        segments.append(torch.full((pad,), B, device=dev))
    ids = torch.cat(pieces).unsqueeze(0)
    pos = torch.cat(positions).unsqueeze(0)
    seg = torch.cat(segments)
    L = seg.numel()
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    mask = (seg.unsqueeze(0) == seg.unsqueeze(1)) & causal
    return PackedRow(ids, pos, mask[None, None], starts, lens)


def _gather_index(packed: PackedRow, T: int) -> torch.Tensor:
    """[B, T] packed positions of each row's tokens; positions past a row's length repeat
    the row's last token (or the packed start for an empty row), so values stay finite."""
    rows = []
    for start, n in zip(packed.starts, packed.lengths):
        rows.append(torch.arange(T).clamp(max=max(n - 1, 0)) + start)
    return torch.stack(rows) if rows else torch.zeros((0, T), dtype=torch.long)


def unpack_to_rows(values: torch.Tensor, packed: PackedRow, T: int) -> torch.Tensor:
    """[1, L, ...] per-position values of a packed row -> [B, T, ...] in row layout
    (differentiable; positions past each row's length hold copies, to be masked)."""
    index = _gather_index(packed, T).to(values.device)
    B = index.shape[0]
    flat = values[0].index_select(0, index.reshape(-1))
    return flat.reshape(B, T, *values.shape[2:])


def unpack_token_logprobs(lp: torch.Tensor, packed: PackedRow, T: int) -> torch.Tensor:
    """Next-token log-probs of a packed row [1, L-1] -> [B, T] with NeMo-RL's convention
    (position 0 and positions past the length are 0; ``out[i, t]`` is the log-prob of token
    ``t`` of row ``i``)."""
    out = torch.zeros((len(packed.starts), T), dtype=lp.dtype, device=lp.device)
    for i, (start, n) in enumerate(zip(packed.starts, packed.lengths)):
        if n > 1:
            out[i, 1:n] = lp[0, start : start + n - 1]
    return out
