"""A plain method that returns a generator object fails with an error naming the method
(a Ray actor method would hand the caller a meaningless value); a generator function's
items still stream."""

from __future__ import annotations

import pytest

import phalanx as px

pytestmark = pytest.mark.timeout(120)


class Lazy(px.Worker):
    def lazy(self):
        return (i * self.rank for i in range(3))

    def lazy_async(self):
        async def agen():
            yield self.rank

        return agen()

    def eager(self):
        yield from range(self.rank, self.rank + 2)


@pytest.fixture(scope="module")
def group(cluster):
    g = Lazy.create_group().launch(
        cluster, placement=px.NodePlacement(num_workers=2), name="gen_return"
    )
    yield g
    g.shutdown()


@pytest.mark.parametrize("method", ["lazy", "lazy_async"])
def test_a_returned_generator_is_an_error_naming_the_method(group, method):
    with pytest.raises(px.WorkerError) as info:
        getattr(group.execute_on(1), method)().wait()
    e = info.value
    assert (e.group, e.rank, e.method, e.cause_type) == ("gen_return", 1, method, "TypeError")
    assert e.message == (
        f"{method}() returned a generator, which a call does not send back: make {method} a "
        "generator function (one that yields: its items are streamed to the caller) or "
        "return a list"
    )


def test_the_worker_stays_usable_and_generator_functions_still_stream(group):
    with pytest.raises(px.WorkerError, match="returned a generator"):
        group.lazy().wait()
    assert group.healthy_worker_ids() == [0, 1]
    assert [list(s) for s in group.eager().wait()] == [[0, 1], [1, 2]]
