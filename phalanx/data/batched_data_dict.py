"""``BatchedDataDict``: a dict of per-sample columns that can be sharded across workers.

Every value is batched along its first dimension: a torch tensor or numpy array (dim 0 is
the batch) or a list/tuple with one item per sample. Non-batched values (scalars, strings,
0-d tensors) are not allowed; ``size`` rejects them. The dict is what a driver hands to a
worker group: ``shard_by_batch_size`` splits it into one piece per data-parallel rank,
optionally sorting by length (dynamic batching) or bin-packing sequences (sequence
packing), and ``reorder_data`` puts the gathered outputs back in the caller's order.

Shapes and semantics follow NeMo-RL's ``BatchedDataDict`` so that its users feel at home.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypedDict, TypeVar

import numpy as np
import torch
from typing_extensions import Self

from phalanx._base.checks import check_choice, check_int, check_rank
from phalanx.data.bin_packing import PACKING_ALGORITHMS, pack
from phalanx.data.columns import batch_len, concat, index_list, is_sequence, slice_rows, take

__all__ = [
    "MICROBATCH_ORDERS",
    "BatchKeysError",
    "ShardingError",
    "PACKING_ALGORITHMS",
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "SequencePackingArgs",
]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class ShardingError(ValueError, AssertionError):
    """A batch that cannot be sharded as asked. NeMo-RL raises ``AssertionError`` (with the
    same leading words) here; this is also a ``ValueError``, phalanx's type for bad input."""


class DynamicBatchingArgs(TypedDict):
    """Settings for dynamic batching in ``shard_by_batch_size``.

    ``input_key`` names the [batch, seq, ...] input tensor, ``input_lengths_key`` the
    per-sample lengths; a micro-batch holds at most ``max_tokens_per_microbatch`` padded
    tokens, its length rounded up to a multiple of ``sequence_length_round``.
    """

    input_key: str
    input_lengths_key: str
    max_tokens_per_microbatch: int
    sequence_length_round: int


class _SequencePackingRequired(TypedDict):
    input_key: str
    input_lengths_key: str
    max_tokens_per_microbatch: int
    algorithm: str


class SequencePackingArgs(_SequencePackingRequired, total=False):
    """Settings for sequence packing in ``shard_by_batch_size``.

    Each micro-batch is a bin whose summed sequence lengths (each rounded up to
    ``sequence_length_pad_multiple``, default 1) fit in ``max_tokens_per_microbatch``;
    ``algorithm`` is one of ``PACKING_ALGORITHMS``. ``microbatch_order`` (default
    ``"packer"``, as NeMo-RL) is the order of each rank's micro-batches: the packer's bin
    order, or ``"largest_first"``: each rank keeps the bins dealt to it and runs them by
    packed tokens, largest first, so the peak-memory micro-batch runs first.
    """

    sequence_length_pad_multiple: int
    microbatch_order: str


MICROBATCH_ORDERS = ("packer", "largest_first")

_DYNAMIC_KEYS = (
    "input_key",
    "input_lengths_key",
    "max_tokens_per_microbatch",
    "sequence_length_round",
)
_PACKING_KEYS = ("input_key", "input_lengths_key", "max_tokens_per_microbatch", "algorithm")


# ----------------------------------------------------------------------------- value helpers


def _rows(b: int, batch: Mapping[str, Any]) -> int:
    """Batch ``b``'s row count, taken from its first field as NeMo-RL does (0 for ``{}``).

    Every other field whose length can be measured must agree; a value without a usable
    length (metadata) is not measured.
    """
    lengths: dict[str, int] = {}
    for key, value in batch.items():
        try:
            lengths[key] = batch_len(key, value)
        except Exception:  # noqa: BLE001 - only the first field must have a length
            if not lengths:
                raise
    if len(set(lengths.values())) > 1:
        raise ValueError(f"batches[{b}]: keys disagree on the number of rows: {lengths}")
    return next(iter(lengths.values()), 0)


class BatchKeysError(KeyError, ValueError):
    """Non-empty batches with different keys (NeMo-RL raises ``KeyError``; also a
    ``ValueError``, phalanx's type for bad input)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _split_sizes(n: int, parts: int, offset: int) -> list[int]:
    """Split ``n`` into ``parts`` sizes differing by at most one.

    The ``n % parts`` larger parts start at ``offset`` (wrapping), so that successive global
    batches hand their extra samples to different shards.
    """
    base, extra = divmod(n, parts)
    sizes = [base] * parts
    for j in range(extra):
        sizes[(offset + j) % parts] += 1
    return sizes


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ----------------------------------------------------------------------------- the dict


class BatchedDataDict(dict, Generic[DictT]):
    """A ``dict`` of batched columns (tensors, arrays, per-sample lists) sharing one batch size.

    ``len()`` is the number of keys, as for any dict; the batch size is ``size``. Shards made
    by ``shard_by_batch_size`` carry micro-batch plans in ``micro_batch_indices`` (per global
    batch, ``[start, end]`` rows relative to that global batch), ``micro_batch_lengths``
    (per global batch, the padded or packed token length of each micro-batch) and
    ``elem_counts_per_gb`` (rows per global batch); elsewhere they are None.

    Args:
        *args, **kwargs: as for ``dict``: the columns.

    Example:
        >>> import torch
        >>> from phalanx import BatchedDataDict
        >>> batch = BatchedDataDict(ids=torch.arange(8).reshape(4, 2), reward=[0.0, 1.0, 0.5, 1.0])
        >>> batch.size
        4
        >>> [shard["reward"] for shard in batch.shard_by_batch_size(2)]
        [[0.0, 1.0], [0.5, 1.0]]
        >>> batch.select_indices([3, 0])["ids"].tolist()
        [[6, 7], [0, 1]]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_indices: list[list[list[int]]] | None = None
        self.micro_batch_lengths: list[list[int]] | None = None
        self.elem_counts_per_gb: list[int] | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, float] | None = None,
    ) -> Self:
        """Concatenate batches along the batch dim.

        Tensors/arrays whose non-batch dims differ are right-padded to the largest size with
        ``pad_value_dict[key]`` (default 0); lists are concatenated. Non-empty batches must
        have the same keys; an empty batch (no rows, e.g. the output of an empty
        data-parallel shard) may lack keys, and an empty list gives an empty dict.

        Args:
            batches: the batches, in order.
            pad_value_dict: the padding value per key.

        Returns:
            The concatenated batch.

        Raises:
            TypeError: ``batches`` is not a sequence of mappings.
            BatchKeysError: two non-empty batches have different keys.
        """
        if isinstance(batches, Mapping) or not is_sequence(batches):
            raise TypeError(f"batches must be a sequence of mappings, got {type(batches).__name__}")
        for b, batch in enumerate(batches):
            if not isinstance(batch, Mapping):
                raise TypeError(f"batches[{b}] is a {type(batch).__name__}, not a mapping")
        if not batches:
            return cls()
        rows = [_rows(b, batch) for b, batch in enumerate(batches)]
        use = [b for b in range(len(batches)) if rows[b]] or list(range(len(batches)))
        keys = list(dict.fromkeys(k for b in use for k in batches[b]))
        for k in dict.fromkeys(k for batch in batches for k in batch):
            lacking = [b for b, batch in enumerate(batches) if rows[b] and k not in batch]
            if lacking:
                having = next(b for b, batch in enumerate(batches) if k in batch)
                raise BatchKeysError(
                    f"Key {k!r} is missing from non-empty batches {lacking} (batches[{having}] "
                    "has it); all non-empty batches need the same keys"
                )
        pads = dict(pad_value_dict or {})
        return cls(
            {
                k: concat(k, [batches[b][k] for b in use if k in batches[b]], pads.get(k, 0))
                for k in keys
            }
        )

    # ------------------------------------------------------------------ basic views

    @property
    def size(self) -> int:
        """The batch size (0 when empty); ValueError if keys disagree."""
        sizes = {k: batch_len(k, v) for k, v in self.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"keys disagree on the batch size: {sizes}")
        return next(iter(sizes.values()), 0)

    def get_dict(self) -> dict[str, Any]:
        """A plain ``dict`` holding the same values (a new dict, values not copied).

        Returns:
            The dict.
        """
        return dict(self)

    def copy(self) -> Self:
        """Shallow copy: a new dict of the same class with the same values and plans.

        Returns:
            The copy.
        """
        out = type(self)(self)
        out._copy_plans_from(self)
        return out

    def _copy_plans_from(self, other: BatchedDataDict) -> None:
        self.micro_batch_indices = _copy.deepcopy(other.micro_batch_indices)
        self.micro_batch_lengths = _copy.deepcopy(other.micro_batch_lengths)
        self.elem_counts_per_gb = _copy.deepcopy(other.elem_counts_per_gb)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"

    def to(self, device: str | torch.device) -> Self:
        """Move all tensors to ``device`` in place; returns self.

        Args:
            device: the target device.

        Returns:
            This batch.
        """
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                self[k] = v.to(device)
        return self

    def slice(self, start: int, end: int) -> Self:
        """Rows ``start:end`` (views for tensors and arrays); bounds must lie in ``[0, size]``.

        Args:
            start: the first row.
            end: one past the last row.

        Returns:
            The new batch.

        Raises:
            ValueError: a bound is out of range.
        """
        size = self.size
        start = check_int(start, "start", 0, size)
        end = check_int(end, "end", start, size)
        return type(self)({k: slice_rows(v, start, end) for k, v in self.items()})

    def select_indices(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> Self:
        """Rows at ``indices`` (any order, repeats allowed) as new storage.

        Args:
            indices: the row positions.

        Returns:
            The new batch.

        Raises:
            IndexError: an index is out of range.
        """
        rows = index_list(indices, self.size, "indices")
        return type(self)({k: take(v, rows) for k, v in self.items()})

    def chunk(self, rank: int, chunks: int) -> Self:
        """The ``rank``-th of ``chunks`` equal contiguous pieces; size must divide evenly.

        Args:
            rank: which piece.
            chunks: how many pieces.

        Returns:
            The piece.

        Raises:
            ValueError: ``chunks`` does not divide the size, or ``rank`` is out of range.
        """
        chunks = check_int(chunks, "chunks", minimum=1)
        rank = check_rank(rank, chunks)
        size = self.size
        if size % chunks:
            raise ValueError(f"chunks ({chunks}) must divide the batch size ({size})")
        step = size // chunks
        return self.select_indices(list(range(rank * step, (rank + 1) * step)))

    def repeat_interleave(self, num_repeats: int) -> Self:
        """Repeat each sample ``num_repeats`` times in place order (a a b b ...).

        List items are deep-copied so that repeated samples can be mutated independently.

        Args:
            num_repeats: copies of each row.

        Returns:
            The new batch.
        """
        num_repeats = check_int(num_repeats, "num_repeats", minimum=1)
        out = type(self)()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v.repeat_interleave(num_repeats, dim=0)
            elif isinstance(v, np.ndarray):
                out[k] = np.repeat(v, num_repeats, axis=0)
            else:
                batch_len(k, v)
                out[k] = [_copy.deepcopy(item) for item in v for _ in range(num_repeats)]
        return out

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """In place, cut every tensor with more than ``dim`` dims to ``truncated_len`` on ``dim``.

        Tensors already shorter than ``truncated_len`` on that dim are left as they are.

        Args:
            dim: the dimension to cut (1 or more).
            truncated_len: the new length.
        """
        dim = check_int(dim, "dim", minimum=1)
        truncated_len = check_int(truncated_len, "truncated_len", minimum=0)
        for k, v in self.items():
            if isinstance(v, torch.Tensor) and v.ndim > dim and v.shape[dim] > truncated_len:
                self[k] = v.narrow(dim, 0, truncated_len)

    def reorder_data(self, reorded_indices: Sequence[int] | torch.Tensor | np.ndarray) -> None:
        """In place, move the row at position ``i`` to position ``reorded_indices[i]``.

        This undoes ``select_indices(p)``: given the ``sorted_indices`` returned by
        ``shard_by_batch_size``, it restores the caller's order of the concatenated shard
        outputs. Micro-batch plans no longer apply afterwards and are cleared.

        Args:
            reorded_indices: a permutation of ``range(size)`` (NeMo-RL's spelling).

        Raises:
            ValueError: it is not a permutation.
        """
        size = self.size
        perm = index_list(reorded_indices, size, "reorded_indices")
        if len(perm) != size or len(set(perm)) != size:
            raise ValueError(
                f"reorded_indices must be a permutation of range({size}), got {len(perm)} "
                f"entries with {len(set(perm))} distinct"
            )
        inverse = [0] * size
        for i, p in enumerate(perm):
            inverse[p] = i
        for k in list(self):
            self[k] = take(self[k], inverse)
        self.micro_batch_indices = self.micro_batch_lengths = self.elem_counts_per_gb = None

    # ------------------------------------------------------------------ sharding

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[Self] | tuple[list[Self], list[int]]:
        """Split into ``shards`` pieces, global batch by global batch.

        The data is cut into global batches of ``batch_size`` rows (default: all of it);
        each global batch is cut into ``shards`` contiguous parts and shard ``i`` is the
        concatenation of part ``i`` of every global batch, so every rank sees every global
        batch in order. E.g. rows 0..7, batch_size=4, shards=2 -> [0 1 4 5], [2 3 6 7].

        Unless ``allow_uneven_shards``, ``batch_size`` must divide the data and ``shards``
        must divide ``batch_size``; with it, parts differ by at most one row (the larger parts
        rotate across global batches so shard totals also differ by at most one).

        ``dynamic_batching_args``: each global batch is sorted by length and dealt
        round-robin to the shards (balancing their load); micro-batch boundaries are
        shared by all shards (same count per shard, for lock-step collectives) and hold at
        most ``max_tokens_per_microbatch`` padded tokens (rows x rounded max length).
        ``sequence_packing_args``: each global batch is bin-packed into micro-batches whose
        summed lengths fit ``max_tokens_per_microbatch``; bins are dealt so every shard gets
        the same number of them. Shard sizes then follow the packing, not
        ``allow_uneven_shards``.

        Returns the list of shards, or with either option ``(shards, sorted_indices)`` where
        the concatenated shards equal ``self.select_indices(sorted_indices)``.

        Args:
            shards: how many shards.
            batch_size: rows per global batch (all rows if None).
            allow_uneven_shards: let parts differ by one row.
            dynamic_batching_args: plan dynamic-shape micro-batches.
            sequence_packing_args: plan packed micro-batches.

        Returns:
            The shards, or ``(shards, sorted_indices)`` with either option.

        Raises:
            ShardingError: the sizes do not divide as required.
        """
        shards = check_int(shards, "shards", minimum=1)
        if batch_size is not None:
            batch_size = check_int(batch_size, "batch_size", minimum=1)
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise ShardingError(
                "dynamic_batching_args and sequence_packing_args cannot be passed together"
            )
        try:
            total = self.size
        except ValueError as e:
            raise ShardingError(
                f"Batch sizes are not the same across the rollout batch: {e}"
            ) from None
        if batch_size is None:
            batch_size = max(total, 1)
        if not allow_uneven_shards:
            if total % batch_size:
                raise ShardingError(
                    f"Total batch size ({total}) is not a multiple of batch_size ({batch_size}); "
                    "pass allow_uneven_shards=True to accept a partial last global batch"
                )
            if batch_size % shards and total:
                raise ShardingError(
                    f"Batch size ({batch_size}) is not a multiple of shards ({shards}); "
                    "pass allow_uneven_shards=True to accept shards differing by one"
                )
        global_batches = [(s, min(s + batch_size, total)) for s in range(0, total, batch_size)]

        if sequence_packing_args is not None:
            return self._shard_packed(shards, global_batches, sequence_packing_args)
        if dynamic_batching_args is not None:
            return self._shard_dynamic(shards, global_batches, dynamic_batching_args)

        rows: list[list[int]] = [[] for _ in range(shards)]
        counts: list[list[int]] = [[] for _ in range(shards)]
        offset = 0
        for start, end in global_batches:
            sizes = _split_sizes(end - start, shards, offset)
            offset = (offset + (end - start)) % shards
            for s, n in enumerate(sizes):
                rows[s].extend(range(start, start + n))
                counts[s].append(n)
                start += n
        out = []
        for s in range(shards):
            shard = self.select_indices(rows[s])
            shard.elem_counts_per_gb = counts[s]
            out.append(shard)
        return out

    def _lengths(
        self, args: Mapping[str, Any], arg_name: str, required: Sequence[str]
    ) -> list[int]:
        """Validate dynamic-batching/packing ``args`` and return the per-sample lengths."""
        if not isinstance(args, Mapping):
            raise TypeError(f"{arg_name} must be a dict, got {type(args).__name__}")
        missing = [k for k in required if k not in args]
        if missing:
            raise ValueError(f"{arg_name} is missing keys {missing}")
        for key in ("input_key", "input_lengths_key"):
            if args[key] not in self:
                raise ValueError(f"{arg_name}[{key!r}] = {args[key]!r} is not a key of the data")
        lengths = self[args["input_lengths_key"]]
        if isinstance(lengths, (torch.Tensor, np.ndarray)):
            if lengths.ndim != 1:
                raise ValueError(f"{arg_name}: input lengths must be 1-D, got {lengths.shape}")
            lengths = lengths.tolist()
        return [check_int(n, f"{arg_name}: input length", minimum=0) for n in lengths]

    def _make_shards(
        self,
        shard_rows: list[list[int]],
        plans: list[tuple[list[list[list[int]]], list[list[int]], list[int]]],
    ) -> tuple[list[Self], list[int]]:
        """Build shards from their row lists and micro-batch plans; also return the permutation."""
        out = []
        for rows, (indices, lengths, counts) in zip(shard_rows, plans):
            shard = self.select_indices(rows)
            shard.micro_batch_indices = indices
            shard.micro_batch_lengths = lengths
            shard.elem_counts_per_gb = counts
            out.append(shard)
        return out, [i for rows in shard_rows for i in rows]

    def _shard_dynamic(
        self, shards: int, global_batches: list[tuple[int, int]], args: DynamicBatchingArgs
    ) -> tuple[list[Self], list[int]]:
        """Sort each global batch by length, deal it to shards, cut shared micro-batches."""
        name = "dynamic_batching_args"
        lengths = self._lengths(args, name, _DYNAMIC_KEYS)
        max_tokens = check_int(
            args["max_tokens_per_microbatch"], f"{name}[max_tokens_per_microbatch]", 1
        )
        rounding = check_int(args["sequence_length_round"], f"{name}[sequence_length_round]", 1)
        inputs = self[args["input_key"]]
        seq_cap = inputs.shape[1] if isinstance(inputs, torch.Tensor) and inputs.ndim > 1 else None

        def padded(n: int) -> int:
            n = _round_up(n, rounding)
            return min(n, seq_cap) if seq_cap is not None else n

        shard_rows: list[list[int]] = [[] for _ in range(shards)]
        plans: list[tuple[list, list, list]] = [([], [], []) for _ in range(shards)]
        offset = 0
        for start, end in global_batches:
            order = sorted(range(start, end), key=lambda i: (lengths[i], i))
            # position j of the sorted batch goes to shard (j + offset) % shards
            per_shard = [order[(s - offset) % shards :: shards] for s in range(shards)]
            offset = (offset + (end - start)) % shards
            positions = max(len(p) for p in per_shard)
            micro: list[list[int]] = []  # [start, end) positions, shared by all shards
            micro_len: list[int] = []  # padded length of each micro-batch
            for pos in range(positions):
                need = max(padded(lengths[p[pos]]) for p in per_shard if pos < len(p))
                if need > max_tokens:
                    raise ValueError(
                        f"{name}: a sample of padded length {need} exceeds "
                        f"max_tokens_per_microbatch ({max_tokens})"
                    )
                grown = max(micro_len[-1], need) if micro else need
                if micro and grown * (pos + 1 - micro[-1][0]) <= max_tokens:
                    micro[-1][1] = pos + 1
                    micro_len[-1] = grown
                else:
                    micro.append([pos, pos + 1])
                    micro_len.append(need)
            for s, rows in enumerate(per_shard):
                shard_rows[s].extend(rows)
                n = len(rows)
                plans[s][0].append([[min(a, n), min(b, n)] for a, b in micro])
                plans[s][1].append(list(micro_len))
                plans[s][2].append(n)
        return self._make_shards(shard_rows, plans)

    def _shard_packed(
        self, shards: int, global_batches: list[tuple[int, int]], args: SequencePackingArgs
    ) -> tuple[list[Self], list[int]]:
        """Bin-pack each global batch (NeMo-RL's layouts) and deal bin ``b`` to shard
        ``b % shards``; the packer makes the bin count a multiple of ``shards``."""
        name = "sequence_packing_args"
        lengths = self._lengths(args, name, _PACKING_KEYS)
        capacity = check_int(
            args["max_tokens_per_microbatch"], f"{name}[max_tokens_per_microbatch]", 1
        )
        multiple = check_int(
            args.get("sequence_length_pad_multiple", 1), f"{name}[sequence_length_pad_multiple]", 1
        )
        algorithm = check_choice(args["algorithm"], PACKING_ALGORITHMS, f"{name}[algorithm]")
        order = args.get("microbatch_order")
        if order is not None:
            check_choice(order, MICROBATCH_ORDERS, f"{name}[microbatch_order]")
        padded = [_round_up(n, multiple) for n in lengths]
        too_long = [n for n in padded if n > capacity]
        if too_long:
            raise ValueError(
                f"{name}: sequences of padded length {too_long[:5]} exceed "
                f"max_tokens_per_microbatch ({capacity})"
            )

        shard_rows: list[list[int]] = [[] for _ in range(shards)]
        plans: list[tuple[list, list, list]] = [([], [], []) for _ in range(shards)]
        for start, end in global_batches:
            local = padded[start:end]
            bins = pack(local, capacity, algorithm, min_bin_count=shards, bin_count_multiple=shards)
            for s in range(shards):
                # Bin b goes to shard b % shards; the order only changes within a shard.
                mine = bins[s::shards]
                if order == "largest_first":
                    mine.sort(key=lambda b: sum(local[i] for i in b), reverse=True)
                micro: list[list[int]] = []
                for members in mine:
                    shard_rows[s].extend(start + i for i in members)
                    n = micro[-1][1] if micro else 0
                    micro.append([n, n + len(members)])
                plans[s][0].append(micro)
                plans[s][1].append([sum(local[i] for i in b) for b in mine])
                plans[s][2].append(micro[-1][1] if micro else 0)
        return self._make_shards(shard_rows, plans)

    # ------------------------------------------------------------------ micro-batches

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> Self:
        """Global batch ``batch_idx`` of this shard, with its micro-batch plan.

        Uses ``elem_counts_per_gb`` when the dict came from ``shard_by_batch_size``;
        otherwise ``batch_size`` rows per global batch.

        Args:
            batch_idx: the global batch.
            batch_size: its rows (needed when the dict was not sharded).

        Returns:
            The global batch.

        Raises:
            IndexError: ``batch_idx`` is out of range.
            ValueError: ``batch_size`` is missing or disagrees with the shard's plan.
        """
        batch_idx = check_int(batch_idx, "batch_idx", minimum=0)
        if self.elem_counts_per_gb is not None:
            counts = self.elem_counts_per_gb
            if batch_idx >= len(counts):
                raise IndexError(
                    f"batch_idx {batch_idx} out of range; {len(counts)} global batches"
                )
            if batch_size is not None and batch_size != counts[batch_idx]:
                raise ValueError(
                    f"batch_size ({batch_size}) disagrees with this shard's global batch "
                    f"{batch_idx}, which holds {counts[batch_idx]} rows"
                )
            start = sum(counts[:batch_idx])
            end = start + counts[batch_idx]
        else:
            if batch_size is None:
                raise ValueError("batch_size is required when elem_counts_per_gb is unset")
            batch_size = check_int(batch_size, "batch_size", minimum=1)
            start, end = batch_idx * batch_size, (batch_idx + 1) * batch_size
            if end > self.size:
                raise IndexError(f"batch_idx {batch_idx} out of range for size {self.size}")
        batch = self.slice(start, end)
        batch.elem_counts_per_gb = [end - start]
        if self.micro_batch_indices is not None:
            batch.micro_batch_indices = _copy.deepcopy([self.micro_batch_indices[batch_idx]])
        if self.micro_batch_lengths is not None:
            batch.micro_batch_lengths = [list(self.micro_batch_lengths[batch_idx])]
        return batch

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[Self]:
        """Yield consecutive slices of ``microbatch_size`` rows; it must divide ``size``.

        Args:
            microbatch_size: rows per micro-batch.

        Returns:
            An iterator over the micro-batches.

        Raises:
            ValueError: ``microbatch_size`` does not divide the size.
        """
        microbatch_size = check_int(microbatch_size, "microbatch_size", minimum=1)
        size = self.size
        if size % microbatch_size:
            raise ValueError(f"microbatch_size ({microbatch_size}) must divide the size ({size})")
        return (self.slice(i, i + microbatch_size) for i in range(0, size, microbatch_size))

    def _planned_microbatches(self) -> list[tuple[int, int, int]]:
        """(start, end, length) of every planned micro-batch, in absolute rows."""
        if self.micro_batch_indices is None or self.micro_batch_lengths is None:
            raise ValueError(
                "no micro-batch plan: make this dict with shard_by_batch_size(..., "
                "dynamic_batching_args=... or sequence_packing_args=...)"
            )
        n_gb = len(self.micro_batch_indices)
        if self.elem_counts_per_gb is not None:
            offsets = [sum(self.elem_counts_per_gb[:g]) for g in range(n_gb)]
        elif n_gb == 1:
            offsets = [0]
        else:
            raise ValueError("several global batches need elem_counts_per_gb to locate them")
        return [
            (offset + a, offset + b, length)
            for offset, idx, lens in zip(
                offsets, self.micro_batch_indices, self.micro_batch_lengths
            )
            for (a, b), length in zip(idx, lens)
        ]

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1) -> Iterator[Self]:
        """Yield the dynamic-batching micro-batches, tensors cut to each one's padded length.

        Args:
            sequence_dim: the tensors' sequence dimension.

        Returns:
            An iterator over the micro-batches.
        """
        plan = self._planned_microbatches()

        def generate() -> Iterator[Self]:
            for start, end, length in plan:
                mb = self.slice(start, end)
                mb.truncate_tensors(dim=sequence_dim, truncated_len=length)
                yield mb

        return generate()

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        """Number of micro-batches ``make_microbatch_iterator_with_dynamic_shapes`` yields.

        Returns:
            The number of micro-batches.
        """
        return len(self._planned_microbatches())

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[Self]:
        """Yield the sequence-packing micro-batches (bins), tensors untouched.

        Returns:
            An iterator over the micro-batches.
        """
        plan = self._planned_microbatches()
        return (self.slice(start, end) for start, end, _ in plan)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> tuple[int, int]:
        """(number of packed micro-batches, largest packed token count among them).

        Returns:
            ``(micro-batches, largest token count)``.
        """
        plan = self._planned_microbatches()
        return len(plan), max((length for _, _, length in plan), default=0)
