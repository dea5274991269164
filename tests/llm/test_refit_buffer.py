"""Refit by IPC handles on the CPU (shared memory), policy and generator in this process:
the policy packs every version into one buffer and sends the same handle, the generator
maps that buffer once, and a new layout gets a new buffer that replaces the old mapping.

The same code runs on a GPU with CUDA memory (``tests/gpu/test_refit_cuda_ipc.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

from phalanx.llm.generation import HFGenerationWorker
from phalanx.llm.policy_worker import DTensorPolicyWorker
from phalanx.llm.refit_source import RefitSource
from phalanx.weights import mapped_buffer, mapped_views
from tests.gpu.procs import policy_config, rank0_env_vars
from tests.helpers import shm_files

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pair(model_path, tokenizer):
    """A one-rank CPU policy (gloo) and a generation worker, both in this process."""
    env = rank0_env_vars()
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        policy = DTensorPolicyWorker(
            policy_config(model_path), tokenizer, init_optimizer=False, init_reference_model=False
        )
        gen = HFGenerationWorker(
            {"model_name": model_path, "max_new_tokens": 4, "num_threads": threads}, tokenizer
        )
        try:
            yield policy, gen
        finally:
            policy.shutdown()


def _refit(policy, gen, keys=None):
    """One refit through NeMo-RL's three methods; the handle the generator got."""
    info, _ = policy.prepare_weights_for_ipc()
    handles = policy.get_weights_ipc_handles(keys or [k for k, _ in info])
    assert gen.update_weights_from_ipc_handles(handles) is True
    (handle,) = handles.values()
    return handle


def _mapped(path):
    """True while this process maps the file ``path`` (deleted or not)."""
    with open("/proc/self/maps") as f:
        return any(line.split()[5:6] == [path] for line in f)


def _assert_holds(gen, state):
    got = gen.get_state_dict()
    assert got.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_two_refits_reuse_the_buffer_its_handle_and_the_mapping(pair):
    policy, gen = pair
    versions, handles, maps = [], [], []
    for step in range(2):
        policy._add_noise_to_weights(0.05, 10 + step)
        handles.append(_refit(policy, gen))
        maps.append(mapped_buffer(gen))
        versions.append({k: v.clone() for k, v in policy.return_full_state_dict().items()})
        _assert_holds(gen, versions[-1])
        # the generator copied: its weights live in no shared segment
        assert shm_files(gen.model.state_dict().values())[0] == set()
    assert handles[0]["kind"] == "shm"
    assert handles[1] is handles[0]  # the same handle object, sent again
    assert maps[1] is maps[0]  # mapped once
    assert maps[0].data_ptr() == maps[1].data_ptr()
    assert policy._refit._ipc_buffer.allocations == 1
    assert any(not torch.equal(versions[0][k], versions[1][k]) for k in versions[0])


def test_a_layout_change_reallocates_and_the_generator_reopens(pair):
    policy, gen = pair
    policy._add_noise_to_weights(0.05, 20)
    full = _refit(policy, gen)
    buffers = policy._refit._ipc_buffer.allocations
    names = sorted(full["layout"].specs, key=lambda s: s.nbytes)
    keep = [s.name for s in names[1:]]  # every tensor but the smallest: another layout
    policy._add_noise_to_weights(0.05, 21)
    part = _refit(policy, gen, keep)
    assert part["name"] != full["name"] and part["buffer"] != full["buffer"]
    assert policy._refit._ipc_buffer.allocations == buffers + 1
    old = os.path.join("/dev/shm", full["name"])
    assert not os.path.exists(old)  # the sender unlinked the old segment
    assert not _mapped(old)  # and nobody maps it any more
    assert _mapped(os.path.join("/dev/shm", part["name"]))
    state = policy.return_full_state_dict()
    got = gen.get_state_dict()
    for k in keep:
        assert torch.equal(got[k], state[k]), k
    # back to every tensor: a third buffer, and the generator holds the whole version
    again = _refit(policy, gen)
    assert again["buffer"] not in (full["buffer"], part["buffer"])
    assert policy._refit._ipc_buffer.allocations == buffers + 2
    _assert_holds(gen, state)


class _Reader:
    """A receiver of mapped views (its receiver state keeps the mapping)."""


def test_a_refit_source_reads_its_model_once_and_sends_what_the_model_holds_now():
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)
    )
    with torch.no_grad():
        model[1].running_mean.uniform_()
    calls = [0]
    model.register_state_dict_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    source = RefitSource(model, None, {}, torch.bfloat16, torch.device("cpu"), 0, lambda: "cpu:t")
    reader = _Reader()

    def refit():
        info, _ = source.prepare_weights_for_ipc()
        (handle,) = source.get_weights_ipc_handles([k for k, _ in info]).values()
        return {k: v.clone() for k, v in mapped_views(reader, handle).items()}

    def assert_sent(got):
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        want = {
            k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v
            for k, v in named.items()
        }
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k

    try:
        assert_sent(refit())
        assert calls == [1]
        with torch.no_grad():
            model[0].weight.mul_(2)  # trained in place
        assert_sent(refit())
        model[0].weight.data = torch.full((3, 4), 0.5)  # new data, same tensor
        assert_sent(refit())
        assert calls == [1]  # neither needed the state dict again
        model[2].bias = torch.nn.Parameter(torch.tensor([3.0, -1.0]))  # a new tensor
        assert_sent(refit())
        assert calls == [2]
        model.double()  # new buffer tensors, put in place without registering them
        with torch.no_grad():
            model[1].running_var.mul_(3)
        assert_sent(refit())
        assert calls == [3]
        assert source._ipc_buffer.allocations == 1  # one layout throughout (sent as bf16)
    finally:
        source.close()
