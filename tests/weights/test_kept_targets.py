"""What a refit keeps between versions instead of reading it again: a receiving module's
tensors by name (read once per ``bindings_epoch``), and a layout that pickles as columns.
Every check that protects the receiver (names, shapes, dtypes) still runs each version."""

from __future__ import annotations

import pickle

import pytest
import torch

from phalanx.weights import WeightMismatchError, apply_weights, bindings_epoch, gather
from phalanx.weights.targets import target_tensors

pytestmark = pytest.mark.timeout(60)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))


def _count_state_dicts(module: torch.nn.Module) -> list[int]:
    calls = [0]

    def hook(*_):
        calls[0] += 1

    module.register_state_dict_post_hook(hook)
    return calls


def test_layout_pickles_as_columns_and_comes_back_equal():
    named = {
        "a": torch.zeros(3, 4),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "scalar": torch.zeros(()),
        "empty": torch.zeros(0, 2),
        "count": torch.zeros(2, dtype=torch.int64),
    }
    named["tied"] = named["a"]
    layout, _ = gather(named, dtype=torch.float16)
    assert layout.aliases == {"tied": "a"}
    blob = pickle.dumps(layout)
    assert pickle.loads(blob) == layout
    assert blob.count(b"TensorSpec") == 0  # rebuilt from columns, not pickled spec by spec
    empty, _ = gather({})
    assert pickle.loads(pickle.dumps(empty)) == empty


def test_bindings_epoch_counts_registrations_not_data_changes():
    """(``Module._apply`` replaces buffers without registering them: ``target_tensors``
    checks each name's tensor besides the epoch, see the next test.)"""
    net = Net()
    start = bindings_epoch()
    net.lin.weight.data = torch.zeros(3, 4)  # same tensor, new data
    net.to(torch.float64)
    with torch.no_grad():
        net.lin.bias.add_(1)
    assert bindings_epoch() == start
    net.lin.weight = torch.nn.Parameter(torch.zeros(3, 4))
    assert bindings_epoch() == start + 1
    net.scale = torch.zeros(3)  # an existing buffer, assigned again
    assert bindings_epoch() == start + 2
    net.extra = torch.nn.Linear(1, 1)  # a submodule (and, inside it, two parameters)
    assert bindings_epoch() > start + 2


def test_target_tensors_reads_the_state_dict_once_per_epoch():
    net = Net()
    calls = _count_state_dicts(net)
    first = target_tensors(net)
    assert calls == [1] and list(first) == ["scale", "lin.weight", "lin.bias"]
    first.pop("scale")  # the caller's copy: the kept one is not changed
    second = target_tensors(net)
    assert calls == [1] and list(second) == ["scale", "lin.weight", "lin.bias"]
    assert all(second[k] is t for k, t in first.items())
    net.lin.weight = torch.nn.Parameter(torch.zeros(3, 4))
    third = target_tensors(net)
    assert calls == [2] and third["lin.weight"] is net.lin.weight
    net.head = torch.nn.Linear(3, 1)
    assert list(target_tensors(net))[3:] == ["head.weight", "head.bias"]
    assert calls == [3]
    old_scale = net.scale
    net.double()  # Module._apply puts a new buffer in place without registering it
    assert net.scale is not old_scale
    assert target_tensors(net)["scale"] is net.scale and calls == [4]
    assert target_tensors(net)["lin.weight"] is net.lin.weight and calls == [4]
    swapped = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.float64))
    net.lin._parameters["weight"] = swapped  # as FSDP2 swaps its parameters: no hook runs
    assert target_tensors(net)["lin.weight"] is swapped and calls == [5]


class Receiver:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


def test_each_version_is_checked_and_lands_in_the_tensors_the_module_holds_now():
    net = Net()
    worker = Receiver(net)
    named = {k: torch.randn(v.shape) for k, v in net.state_dict().items()}
    layout, sources = gather(named)
    by_name = {s.name: t for s, t in zip(layout.specs, sources)}
    assert apply_weights(worker, layout, by_name) is True
    net.lin.weight = torch.nn.Parameter(torch.zeros(3, 4))  # replaced: the copy goes to it
    assert apply_weights(worker, layout, by_name) is True
    assert torch.equal(net.lin.weight.detach(), named["lin.weight"])
    net.to(torch.float16)  # new dtypes (and a new buffer tensor): refused
    with pytest.raises(WeightMismatchError, match="'scale': dtype mismatch"):
        apply_weights(worker, layout, by_name)
    assert net.lin.weight.dtype == torch.float16
