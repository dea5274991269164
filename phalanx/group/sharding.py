"""Named N-dimensional layouts of worker ranks (NeMo-RL's ``NamedSharding``).

A worker group places its ranks on a grid whose axes have names such as ``dp``, ``pp``,
``tp``. Dispatch code asks which ranks sit at given coordinates (all ranks of DP shard 2,
the TP leader of each DP shard) and where a given rank sits; both answers come from tables
built once in ``__init__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from phalanx._base.checks import check_int

__all__ = ["NamedSharding"]


class NamedSharding:
    """An N-dimensional arrangement of unique worker ranks with one name per axis.

    Example: ``NamedSharding([[0, 1], [2, 3]], ["dp", "tp"])`` is DP=2 x TP=2; rank 3 sits
    at ``{"dp": 1, "tp": 1}`` and ``get_ranks(dp=1)`` is the 1-D sharding of ranks
    ``[2, 3]`` on axis ``tp``, as in NeMo-RL.

    Args:
        layout: a nested list (or array) of the ranks, one dimension per axis.
        names: the axes' names.

    Raises:
        ValueError: the layout is not a rectangular array of unique non-negative int
            ranks, or the names repeat or do not match its dimensions.
        TypeError: a name is not a non-empty str.
    """

    def __init__(self, layout: Sequence[Any] | np.ndarray, names: Sequence[str]) -> None:
        """Validate ``layout`` and ``names`` and precompute the rank and axis lookup tables.

        As in NeMo-RL, ranks must be unique integers (integral floats such as ``1.0`` are
        accepted) and need not be ``0..N-1`` (a slice of a bigger layout is a valid
        sharding). phalanx also rejects negative ranks and empty layouts. Raises ValueError
        (TypeError for wrong name types) naming ``layout`` or ``names``.
        """
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise TypeError(f"names must be a sequence of strings, got {names!r}")
        names = list(names)
        for name in names:
            if not isinstance(name, str) or not name:
                raise TypeError(f"names must be non-empty strings, got {name!r} in {names}")
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique, got {names}")

        try:
            array = np.asarray(layout)
        except ValueError as exc:  # ragged nested lists
            raise ValueError(f"layout must be a rectangular array of ranks: {exc}") from exc
        if array.ndim == 0 or array.size == 0:
            raise ValueError(
                f"layout must have at least one dimension and one rank, got {layout!r}"
            )
        if array.dtype == np.bool_ or not (
            np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
        ):
            raise ValueError(
                f"layout: Layout must contain only integer rank IDs, got dtype {array.dtype}"
            )
        is_float = np.issubdtype(array.dtype, np.floating)
        if is_float and not (np.all(np.isfinite(array)) and np.all(np.mod(array, 1) == 0)):
            raise ValueError(
                f"layout: Layout must contain only integer rank IDs, got {array.tolist()}"
            )
        if array.ndim != len(names):
            raise ValueError(
                f"Number of dimensions in layout ({array.ndim}, shape {array.shape}) must "
                f"match the number of names ({len(names)}: {names}); give one name per dimension"
            )
        array = array.astype(np.int64)
        flat = array.ravel()
        negative = sorted(set(flat[flat < 0].tolist()))
        if negative:
            raise ValueError(f"layout: ranks must be non-negative, got {negative}")
        unique, counts = np.unique(flat, return_counts=True)
        duplicated = unique[counts > 1].tolist()
        if duplicated:
            raise ValueError(f"layout: Duplicate ranks found in layout: {duplicated}")
        array.setflags(write=False)

        self._layout = array
        self._names = names
        self._axis_index = {name: i for i, name in enumerate(names)}
        self._shape = {name: int(size) for name, size in zip(names, array.shape)}
        # rank -> coordinates, filled once so lookups never search the layout.
        self._coords: dict[int, dict[str, int]] = {}
        for index in np.ndindex(array.shape):
            self._coords[int(array[index])] = {name: int(i) for name, i in zip(names, index)}

    @classmethod
    def default(cls, n: int) -> NamedSharding:
        """Return the 1-D sharding of ``n`` ranks on one axis ``dp`` (pure data parallel).

        Args:
            n: the number of ranks.

        Returns:
            The sharding.

        Raises:
            ValueError: ``n`` is below 1.
        """
        n = check_int(n, "n", minimum=1)
        return cls(np.arange(n), ["dp"])

    @property
    def layout(self) -> np.ndarray:
        """The read-only array of ranks, one dimension per axis name."""
        return self._layout

    @property
    def names(self) -> list[str]:
        """The axis names, outermost first (a copy)."""
        return list(self._names)

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return self._layout.ndim

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._layout.size

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> axis size (a copy)."""
        return dict(self._shape)

    def get_axis_index(self, name: str) -> int:
        """Position of axis ``name`` in the layout; ValueError if there is no such axis.

        Args:
            name: the axis's name.

        Returns:
            Its position.

        Raises:
            ValueError: there is no such axis.
        """
        try:
            return self._axis_index[name]
        except (KeyError, TypeError):
            raise ValueError(
                f"Invalid axis name: {name!r}. Valid names are: {self._names}"
            ) from None

    def get_axis_size(self, name: str) -> int:
        """Size of axis ``name``; ValueError if there is no such axis.

        Args:
            name: the axis's name.

        Returns:
            Its size.

        Raises:
            ValueError: there is no such axis.
        """
        self.get_axis_index(name)
        return self._shape[name]

    def contains_worker_id(self, worker_id: int) -> bool:
        """Whether ``worker_id`` is one of this sharding's ranks.

        Args:
            worker_id: the rank.

        Returns:
            Whether it is one.

        Raises:
            TypeError: ``worker_id`` is not an int.
        """
        return check_int(worker_id, "worker_id") in self._coords

    def get_worker_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` as axis name -> index (a fresh dict).

        A rank that is not in the layout is a ValueError, as in NeMo-RL.

        Args:
            rank: the rank.

        Returns:
            A dict from axis name to index.

        Raises:
            ValueError: the rank is not in the layout.
        """
        rank = check_int(rank, "rank")
        coords = self._coords.get(rank)
        if coords is None:
            raise ValueError(
                f"Worker ID {rank} not found in sharding layout (its ranks are "
                f"{sorted(self._coords)[:16]}{'...' if self.size > 16 else ''})"
            )
        return dict(coords)

    def _index(self, coords: dict[str, Any], strict: bool) -> tuple[Any, ...] | None:
        """Numpy index for the given partial coordinates; None if out of range and not strict."""
        index: list[Any] = [slice(None)] * self.ndim
        for name, value in coords.items():
            axis = self.get_axis_index(name)
            value = check_int(value, f"coordinate {name}")
            if not 0 <= value < self._layout.shape[axis]:
                if not strict:
                    return None
                raise IndexError(
                    f"Index {value} is out of bounds for axis {name!r} with size "
                    f"{self._layout.shape[axis]}"
                )
            index[axis] = value
        return tuple(index)

    def get_ranks(self, **coords: int) -> NamedSharding | int:
        """The ranks left after fixing the given axes, as NeMo-RL returns them.

        All axes fixed: the rank, an ``int``. Otherwise a ``NamedSharding`` over the axes
        not fixed (in layout order) holding those ranks; with no coordinates, a sharding
        equal to this one. Unknown axis -> ValueError; coordinate out of range ->
        IndexError. ``get_ranks_by_coord`` gives the same ranks as a sorted flat list.

        Args:
            **coords: an index per fixed axis.

        Returns:
            The rank, or a ``NamedSharding`` of the ranks left.

        Raises:
            ValueError: an axis is unknown.
            IndexError: a coordinate is out of range.
        """
        index = self._index(coords, strict=True)
        assert index is not None
        selected = self._layout[index]
        if selected.ndim == 0:
            return int(selected)
        fixed = {self._axis_index[name] for name in coords}
        remaining = [name for i, name in enumerate(self._names) if i not in fixed]
        return NamedSharding(selected, remaining)

    def get_ranks_by_coord(self, **coords: int) -> list[int]:
        """Sorted flat list of the ranks matching the partial coordinates.

        As in NeMo-RL, a coordinate outside its axis matches nothing (empty list); an
        unknown axis name is a ValueError.

        Args:
            **coords: an index per fixed axis.

        Returns:
            The ranks, sorted.

        Raises:
            ValueError: an axis is unknown.
        """
        index = self._index(coords, strict=False)
        if index is None:
            return []
        return sorted(np.ravel(self._layout[index]).tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NamedSharding):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._layout, other._layout)

    def __hash__(self) -> int:
        return hash((tuple(self._names), self._layout.shape, self._layout.tobytes()))

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild through __init__ so the copy is validated and its layout stays read-only.
        return (type(self), (self._layout.tolist(), list(self._names)))

    def __repr__(self) -> str:
        shape = ", ".join(str(self._shape[n]) for n in self._names)
        return f"NamedSharding(shape=({shape}), names={self._names}, layout={self._layout})"
