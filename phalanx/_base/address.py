"""Hierarchical worker addresses: ``group:rank[:child_rank...]``."""

from __future__ import annotations


class WorkerAddress:
    """A root group name plus a path of ranks, e.g. ``learner:0`` or ``learner:0:2``.

    Any worker can name any other worker by its address, across groups.

    Args:
        root_group_name: the root group's name.
        ranks: the path of ranks below it.
    """

    __slots__ = ("root_group_name", "rank_path")

    def __init__(self, root_group_name: str, ranks: int | list[int] | tuple[int, ...] = ()):
        if not isinstance(root_group_name, str) or not root_group_name:
            raise ValueError(f"root_group_name must be a non-empty string, got {root_group_name!r}")
        if ":" in root_group_name:
            raise ValueError(f"root_group_name may not contain ':', got {root_group_name!r}")
        if isinstance(ranks, int):
            ranks = [ranks]
        ranks = [int(r) for r in ranks]
        if any(r < 0 for r in ranks):
            raise ValueError(f"ranks must be non-negative, got {ranks}")
        self.root_group_name = root_group_name
        self.rank_path = tuple(ranks)

    @classmethod
    def from_name(cls, name: str) -> WorkerAddress:
        """Parse ``group:0:1`` back into an address.

        Args:
            name: a name from ``get_name``.

        Returns:
            The address.

        Raises:
            ValueError: a rank in the name is not an int.
        """
        root, *ranks = name.split(":")
        return cls(root, [int(r) for r in ranks])

    @property
    def rank(self) -> int:
        """This worker's rank within its immediate parent (0 for a root address)."""
        return self.rank_path[-1] if self.rank_path else 0

    def get_name(self) -> str:
        """The address as a string, ``group:rank[:rank...]``.

        Returns:
            The name.
        """
        return self.root_group_name + "".join(f":{r}" for r in self.rank_path)

    def get_parent_rank(self) -> int:
        """Rank of the parent worker, or 0 when this worker sits directly under the root group.

        Returns:
            The rank.
        """
        return self.rank_path[-2] if len(self.rank_path) > 1 else 0

    def get_parent_address(self) -> WorkerAddress | None:
        """The address one level up, or None for the root group itself.

        Returns:
            The parent's address, or None.
        """
        if not self.rank_path:
            return None
        return WorkerAddress(self.root_group_name, list(self.rank_path[:-1]))

    def get_child_address(self, rank: int) -> WorkerAddress:
        """The address of child ``rank`` of this worker.

        Args:
            rank: the child's rank.

        Returns:
            The child's address.
        """
        return WorkerAddress(self.root_group_name, [*self.rank_path, rank])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerAddress) and (
            self.root_group_name,
            self.rank_path,
        ) == (other.root_group_name, other.rank_path)

    def __hash__(self) -> int:
        return hash((self.root_group_name, self.rank_path))

    def __repr__(self) -> str:
        return f"WorkerAddress({self.get_name()!r})"

    def __str__(self) -> str:
        return self.get_name()
