"""Addressing ranks of a group that is shut down (or not launched) says so, rather than
calling every rank out of range of a group of 0 workers."""

from __future__ import annotations

import pytest

import phalanx as px

pytestmark = pytest.mark.timeout(120)


class Echo(px.Worker):
    def hello(self):
        return self.rank


def test_ranks_of_a_shut_down_group(cluster):
    g = Echo.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="ranks_after_shutdown"
    )
    assert g.execute_on(1).hello().wait() == [1]
    g.shutdown()
    shut = "group 'ranks_after_shutdown' is shut down; launch a new group"
    for address in (
        lambda: g.execute_on(0),
        lambda: g.call("hello", ranks=[0]),
        lambda: g.call_ranks("hello", [(0, (), {})]),
    ):
        with pytest.raises(RuntimeError) as info:
            address()
        assert str(info.value) == shut


def test_ranks_of_a_group_not_launched_yet():
    g = Echo.create_group()
    with pytest.raises(RuntimeError, match=r"^group '.*' is not launched yet$"):
        g.execute_on(0)
