"""What a send refuses or reports: missing keys, NaN/Inf, receivers without a model, and a
closed sender's restart hook."""

from __future__ import annotations

import math

import pytest
import torch

import phalanx as px
from phalanx.weights import NoModelError


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


class Holder(px.Worker):
    def __init__(self):
        super().__init__()
        self.model = make_model()
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def versions(self) -> tuple[int, tuple[str, ...]]:
        return self.weights_version, self.weights_missing


class Empty(px.Worker):
    """Holds no model at all."""


@pytest.fixture(scope="module")
def holders(cluster):
    g = Holder.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="w_checks")
    yield g
    g.shutdown()


def _ones(model: torch.nn.Module, value: float) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v, value) for k, v in model.state_dict().items()}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["auto", "object_store", "collective"])
def test_missing_key_is_an_error_unless_not_strict(holders, transport):
    model = make_model()
    sender = px.WeightSender(holders, model, transport=transport)
    try:
        full = _ones(model, 1.0)
        assert sender.send(full).applied == [0, 1]
        before = holders.state().wait(timeout=30)
        partial = {k: torch.full_like(v, 2.0) for k, v in full.items() if k != "1.bias"}
        with pytest.raises(px.WeightMismatchError, match=r"missing parameters \['1.bias'\]"):
            sender.send(partial)
        after = holders.state().wait(timeout=30)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(after, before) for k in a)
        result = sender.send(partial, strict=False)
        assert result.applied == [0, 1] and result.partial
        assert result.missing == {0: ["1.bias"], 1: ["1.bias"]}
        for state in holders.state().wait(timeout=30):
            assert torch.equal(state["1.bias"], torch.ones(2))  # kept: not in the version
            assert torch.equal(state["0.weight"], torch.full((8, 8), 2.0))
        assert holders.versions().wait(timeout=30) == [(result.version, ("1.bias",))] * 2
        whole = sender.send(full)
        assert not whole.partial and whole.missing == {}
        assert holders.versions().wait(timeout=30) == [(whole.version, ())] * 2
    finally:
        sender.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_weights_are_refused_before_sending(holders, bad):
    model = make_model()
    sender = px.WeightSender(holders, model)
    try:
        version = sender.version
        weights = _ones(model, 0.5)
        weights["0.weight"][3, 4] = bad
        with pytest.raises(ValueError, match=r"'0.weight' holds 1 NaN/Inf value\(s\) of 64"):
            sender.send(weights)
        assert sender.version == version  # nothing was sent, no version used
        assert holders.versions().wait(timeout=30)[0][0] <= version
        lenient = px.WeightSender(holders, model, allow_nonfinite=True)
        assert lenient.send(weights).applied == [0, 1]
        got = holders.execute_on(0).state().wait(timeout=30)[0]["0.weight"][3, 4]
        assert (math.isnan(bad) and math.isnan(got)) or float(got) == bad
        lenient.close()
    finally:
        sender.close()


@pytest.mark.smoke
def test_large_finite_values_are_not_mistaken_for_inf(holders):
    model = make_model()
    sender = px.WeightSender(holders, model)
    weights = _ones(model, 3e38)  # their sum overflows float32; every value is finite
    assert sender.send(weights).applied == [0, 1]
    sender.close()


@pytest.mark.timeout(60)
def test_send_to_workers_without_a_model_raises(cluster):
    g = Empty.create_group().launch(cluster, px.NodePlacement(num_workers=2), name="w_empty")
    try:
        sender = px.WeightSender(g, make_model())
        with pytest.raises(NoModelError, match=r"workers \[0, 1\] of group w_empty hold no model"):
            sender.send()
        sender.close()
    finally:
        g.shutdown()


@pytest.mark.timeout(60)
def test_closed_sender_no_longer_restores(holders):
    model = make_model()
    sender = px.WeightSender(holders, model)
    weights = _ones(model, 3.0)
    result = sender.send(weights, worker_ids=0)
    assert result.applied == [0]
    v1 = holders.execute_on(1).versions().wait(timeout=30)[0][0]
    assert v1 < result.version
    sender.close()
    holders.run_restart_hooks([1])  # a closed sender re-sends nothing
    assert holders.execute_on(1).versions().wait(timeout=30)[0][0] == v1
    live = px.WeightSender(holders, model)
    live.send(weights, worker_ids=0)
    holders.run_restart_hooks([1])  # an open one does
    assert holders.execute_on(1).versions().wait(timeout=30)[0][0] == live.version
    live.close()


@pytest.mark.smoke
def test_bad_flags(holders):
    with pytest.raises(TypeError, match="strict"):
        px.WeightSender(holders, strict="yes")
    with pytest.raises(TypeError, match="allow_nonfinite"):
        px.WeightSender(holders, allow_nonfinite=1)
