"""Bin packing of sequences into micro-batches, with NeMo-RL's bin layouts.

A packer turns sequence lengths into bins (lists of sequence indices) whose summed lengths
fit ``bin_capacity``. The layouts follow NeMo-RL's ``nemo_rl.data.packing`` algorithms
step for step (same sort orders, same tie-breaking, same bin-count adjustment), so that a
batch sharded by phalanx puts the same sequences on the same data-parallel rank in the same
micro-batch as NeMo-RL does.

- ``first_fit_decreasing``: sequences longest first (ties: higher index first), each into
  the first bin with room.
- ``modified_first_fit_decreasing``: Johnson and Garey's MFFD. Sequences are classed large
  (> C/2), medium (> C/3), small (> C/6) and tiny; one bin per large sequence; one medium
  into each large bin going forward; two smalls into medium-less bins going backward; then
  the largest remaining sequence that fits, bin by bin; what is left is packed by putting
  each sequence (longest first) into the least-filled leftover bin when it fits there.

``adjust_bin_count`` then makes the number of bins at least ``min_bin_count`` and a multiple
of ``bin_count_multiple`` by moving single sequences into new bins, taking them from the
bins holding the most sequences.
"""

from __future__ import annotations

from bisect import bisect
from collections.abc import Callable

__all__ = ["PACKING_ALGORITHMS", "adjust_bin_count", "pack"]


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for length, index in sorted(((n, i) for i, n in enumerate(lengths)), reverse=True):
        for b, free in enumerate(room):
            if free >= length:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(capacity - length)
    return bins


def _modified_first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    large, medium, small, tiny = [], [], [], []
    for item in enumerate(lengths):  # (index, length)
        size = item[1]
        if size > capacity / 2:
            large.append(item)
        elif size > capacity / 3:
            medium.append(item)
        elif size > capacity / 6:
            small.append(item)
        else:
            tiny.append(item)
    # Stable sorts by length alone, as the reference does.
    large.sort(key=lambda t: t[1], reverse=True)
    medium.sort(key=lambda t: t[1], reverse=True)
    small.sort(key=lambda t: t[1])
    tiny.sort(key=lambda t: t[1])

    bins: list[list[tuple[int, int]]] = [[item] for item in large]

    def room(b: list[tuple[int, int]]) -> int:
        return capacity - sum(size for _, size in b)

    for b in bins:  # forward: the first (largest) medium that fits
        free = room(b)
        for k, (_, size) in enumerate(medium):
            if size <= free:
                b.append(medium.pop(k))
                break
    for b in reversed(bins):  # backward: the smallest small plus the largest that fits with it
        has_medium = any(capacity / 3 < size <= capacity / 2 for _, size in b)
        if has_medium or len(small) < 2:
            continue
        free = room(b)
        if small[0][1] + small[1][1] > free:
            continue
        first = small.pop(0)
        # small is ascending and small[0] + small[1] fits, so a partner always exists
        partner = max(k for k in range(len(small)) if small[k][1] <= free - first[1])
        b.extend([first, small.pop(partner)])
    rest = sorted(medium + small + tiny, key=lambda t: t[1], reverse=True)
    for b in bins:  # forward: the largest remaining sequence that fits, while any fits
        while rest:
            free = room(b)
            if free < rest[-1][1]:
                break
            pick = next((k for k, (_, size) in enumerate(rest) if size <= free), None)
            if pick is None:
                break
            b.append(rest.pop(pick))
    # Leftovers: each into the least-filled leftover bin if it fits, else a new bin; the
    # leftover bins are kept ordered by fill.
    extra: list[list[tuple[int, int]]] = [[]]
    fill: list[int] = [0]
    for item in sorted(rest, key=lambda t: t[1], reverse=True):
        if item[1] <= capacity - fill[0]:
            b, used = extra.pop(0), fill.pop(0)
        else:
            b, used = [], 0
        b.append(item)
        used += item[1]
        at = bisect(fill, used)
        extra.insert(at, b)
        fill.insert(at, used)
    bins.extend(b for b in extra if b)
    return [[index for index, _ in b] for b in bins]


_PACKERS: dict[str, Callable[[list[int], int], list[list[int]]]] = {
    "first_fit_decreasing": _first_fit_decreasing,
    "modified_first_fit_decreasing": _modified_first_fit_decreasing,
}
PACKING_ALGORITHMS = tuple(_PACKERS)


def adjust_bin_count(
    bins: list[list[int]], min_bin_count: int | None = None, bin_count_multiple: int | None = None
) -> list[list[int]]:
    """Add bins until there are ``>= min_bin_count`` and a multiple of ``bin_count_multiple``.

    Each new bin takes the last sequence of the bin holding the most sequences (ties: the
    later bin), staying with that bin while it holds more than one. With fewer sequences
    than bins needed, the missing bins stay empty (NeMo-RL raises there; an empty bin
    lets a data-parallel rank with nothing to do still join the collectives).
    """
    target = len(bins)
    if min_bin_count is not None:
        target = max(target, min_bin_count)
    if bin_count_multiple is not None and target % bin_count_multiple:
        target += bin_count_multiple - target % bin_count_multiple
    out = [list(b) for b in bins]
    if target == len(out):
        return out
    order = sorted(((len(b), i) for i, b in enumerate(out)), reverse=True)
    source = 0
    for _ in range(target - len(bins)):
        new: list[int] = []
        while source < len(order):
            b = order[source][1]
            if len(out[b]) > 1:
                new.append(out[b].pop())
                break
            source += 1
        out.append(new)
    return out


def pack(
    lengths: list[int],
    capacity: int,
    algorithm: str,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
) -> list[list[int]]:
    """Bins of indices into ``lengths``, each summing to at most ``capacity``."""
    if algorithm not in _PACKERS:
        raise ValueError(f"algorithm must be one of {PACKING_ALGORITHMS}, got {algorithm!r}")
    if capacity < 1:
        raise ValueError(f"bin capacity must be positive, got {capacity}")
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"sequence lengths {too_long[:5]} exceed the bin capacity {capacity}")
    bins = _PACKERS[algorithm](list(lengths), capacity)
    return adjust_bin_count(bins, min_bin_count, bin_count_multiple)
