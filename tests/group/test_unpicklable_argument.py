"""An argument Ray cannot serialise (nested 100,000 deep) is an error naming the group,
method, rank and the argument, and the group stays usable."""

from __future__ import annotations

import pickle

import pytest

import phalanx as px

pytestmark = pytest.mark.timeout(120)


class Take(px.Worker):
    def take(self, x, y=None):
        return self.rank


def _deep(n: int) -> list:
    deep: list = []
    for _ in range(n):
        deep = [deep]
    return deep


def test_a_too_deep_argument_is_named(cluster):
    g = Take.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="deep_arg"
    )
    try:
        deep = _deep(100_000)
        with pytest.raises(pickle.PicklingError) as info:
            g.take(1, y=deep)
        assert str(info.value) == (
            "deep_arg.take() rank 0: argument 'y' cannot be serialised (PicklingError: Could "
            "not pickle object as excessively deep recursion required.)"
        )
        with pytest.raises(pickle.PicklingError, match=r"rank 1: argument 0 cannot"):
            g.execute_on(1).take(deep)
        assert g.take(1).wait() == [0, 1]
    finally:
        g.shutdown()
