"""A group's state is held, not spread: the call path and each face read only attributes
their own class sets or defines (or their bases define), so what an object holds is
found in its class; ``WorkerGroup`` is no mixin of its faces but holds them and keeps
every method of theirs as its own."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from phalanx.group.call_path import CallPath
from phalanx.group.group import WorkerGroup
from phalanx.group.nemo_face import NemoFace, _ActorProxy
from phalanx.group.rlinf_face import GroupMethod, RankView
from phalanx.group.rllib_face import RllibFace

pytestmark = pytest.mark.timeout(60)


def _sets_and_reads(cls: type) -> tuple[set[str], set[str]]:
    """The names ``cls``'s own source sets or defines (methods, class attributes with a
    value, ``self.<name> = ...``) and the ``self.<name>`` it reads."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # a built-in class
        return set(vars(cls)), set()
    tree = ast.parse(source)
    body = tree.body[0].body
    own = {n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for n in body:  # an annotation alone sets nothing
        if isinstance(n, ast.Assign):
            own.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.AnnAssign) and n.value is not None:
            own.add(n.target.id)
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self":
            (own if isinstance(node.ctx, ast.Store) else reads).add(node.attr)
    return own, reads


def foreign_reads(cls: type) -> list[str]:
    """The ``self.<name>`` that ``cls`` reads but that neither it nor a base class sets
    or defines: state some other class must set on it."""
    own, reads = _sets_and_reads(cls)
    reads = {r for r in reads if not r.startswith("__")}  # Python's own (``__dict__``)
    for base in cls.__mro__[1:]:
        own |= _sets_and_reads(base)[0] | set(vars(base))
    return sorted(reads - own)


def test_foreign_reads_names_what_a_mixin_reads_of_its_host():
    class Host:
        def __init__(self):
            self.size = 1

    class Mixin:
        name: str

        def describe(self):
            return f"{self.name}: {self._size_of()} {self.size}"

        def _size_of(self):
            return len(self.__class__.__name__)

    class Holder(Host):
        def __init__(self):
            super().__init__()
            self._parts = []

        def count(self):
            return len(self._parts) + self.size

    assert foreign_reads(Mixin) == ["name", "size"]
    assert foreign_reads(Holder) == []


@pytest.mark.parametrize(
    "cls", [CallPath, NemoFace, _ActorProxy, RllibFace, GroupMethod, RankView, WorkerGroup]
)
def test_each_class_reads_only_state_it_holds(cls):
    assert foreign_reads(cls) == []


NEMO_RL = (
    "workers",
    "worker_metadata",
    "master_address",
    "master_port",
    "dp_size",
    "get_dp_leader_worker_idx",
    "run_single_worker_single_data",
    "run_all_workers_single_data",
    "run_all_workers_multiple_data",
    "run_all_workers_sharded_data",
    "get_all_worker_results",
)
RLLIB = (
    "foreach_worker",
    "foreach_worker_with_id",
    "foreach_actor",
    "foreach_worker_async",
    "foreach_actor_async",
    "num_in_flight_async_reqs",
    "fetch_ready_async_reqs",
    "fetch_ready_async_results",
    "healthy_worker_ids",
    "num_healthy_workers",
    "num_healthy_remote_workers",
    "num_remote_workers",
    "num_remote_worker_restarts",
    "probe_unhealthy_workers",
    "is_actor_healthy",
    "set_actor_state",
    "take_out_of_service",
    "probe_unhealthy_actors",
)


def test_the_group_defines_every_face_method_itself():
    assert WorkerGroup.__bases__ == (object,)
    missing = [name for name in NEMO_RL + RLLIB if name not in vars(WorkerGroup)]
    assert missing == []
