"""The examples in the docstrings of the main public classes run and print what they say.

Those that need no Ray run as doctests; those that start workers run the same way on the
session's shared Ray (the ``cluster`` fixture).
"""

from __future__ import annotations

import doctest

import pytest

import phalanx

WITHOUT_RAY = ["BatchedDataDict", "Worker"]
WITH_RAY = ["WorkerGroup", "Channel", "WeightSender", "EnvRunnerGroup", "Policy"]


def run_example(name: str) -> None:
    """Run the ``Example:`` of ``phalanx.<name>``'s class docstring; fail on any mismatch."""
    obj = getattr(phalanx, name)
    test = doctest.DocTestParser().get_doctest(
        obj.__doc__, {}, f"phalanx.{name}", obj.__module__, 0
    )
    assert test.examples, f"phalanx.{name} has no example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False).failed == 0, f"phalanx.{name}'s example failed"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", WITHOUT_RAY)
def test_example_without_ray(name: str) -> None:
    run_example(name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", WITH_RAY)
def test_example_on_ray(cluster: phalanx.Cluster, name: str) -> None:
    run_example(name)
