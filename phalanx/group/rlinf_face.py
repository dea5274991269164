"""RLinf's face of a group: ``group.method(...)`` and ``group.execute_on(*ranks).method(...)``.

``WorkerGroup.__getattr__`` and ``WorkerGroup.execute_on`` hand out the objects here: a
worker class's public method, bound to the group's call path and to all ranks or some,
which calls it with the same arguments on each (:meth:`CallPath.call`) and returns the
``GroupHandle``.
"""

from __future__ import annotations

from typing import Any

from phalanx.group.call_path import CallPath
from phalanx.group.futures import GroupHandle


class GroupMethod:
    """``group.method`` (or ``group.execute_on(...).method``): calling it dispatches.

    Args:
        path: the group's call path.
        name: the worker method's name.
        ranks: the ranks it runs on (None: every rank, leaving out dead ones when the
            group's policy ignores failures).
    """

    __slots__ = ("_path", "_name", "_ranks")

    def __init__(self, path: CallPath, name: str, ranks: list[int] | None):
        self._path, self._name, self._ranks = path, name, ranks

    def __call__(self, *args: Any, **kwargs: Any) -> GroupHandle:
        path = self._path
        if self._ranks is None:
            calls = [(r, args, kwargs) for r in path.ranks]
            return path.call(self._name, calls, health=path.broadcast_health())
        return path.call(self._name, [(r, args, kwargs) for r in self._ranks])

    def __repr__(self) -> str:
        return f"<group method {self._path.name}.{self._name}>"


class RankView:
    """The group restricted to some ranks, for the next call.

    Args:
        path: the group's call path.
        ranks: the ranks, checked.
    """

    __slots__ = ("_path", "_ranks")

    def __init__(self, path: CallPath, ranks: list[int]):
        self._path, self._ranks = path, ranks

    def __getattr__(self, name: str) -> GroupMethod:
        self._path.check_method(name)
        return GroupMethod(self._path, name, self._ranks)


__all__ = ["GroupMethod", "RankView"]
