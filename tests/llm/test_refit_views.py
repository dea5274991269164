"""CPU refit into read-only generation workers: their parameters view the sender's ring.

The policy's ranks write their own rows into the next buffer of the refit sender's
versioned ring; ``HFGenerationWorker`` (``read_only_weights``) takes that buffer as its
parameters between calls. No copy on the generator side.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import phalanx as px
from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts
from phalanx.llm.generation import HFGenerationWorker
from phalanx.llm.policy import Policy
from phalanx.llm.refit import Refitter
from tests.helpers import shm_files, until

pytestmark = pytest.mark.timeout(300)


def _gen_cfg(path, **over):
    cfg = {"model_name": path, "max_new_tokens": 6, "seed": 1, "num_threads": 1}
    cfg.update(over)
    return cfg


def _policy(cluster, model_path, tokenizer, workers, name):
    cfg = {
        "model_name": model_path,
        "train_global_batch_size": 2,
        "train_micro_batch_size": 1,
        "max_total_sequence_length": 32,
    }
    return Policy(
        cluster,
        cfg,
        tokenizer,
        num_workers=workers,
        name_prefix=name,
        init_optimizer=False,
        init_reference_model=False,
    )


@pytest.fixture(scope="module")
def setup(cluster, model_path, tokenizer):
    policy = _policy(cluster, model_path, tokenizer, 2, "view_pol")
    gen = HFGenerationWorker.create_group(_gen_cfg(model_path), tokenizer).launch(
        cluster,
        px.NodePlacement(num_workers=2),
        name="view_gen",
        restart_policy=px.RestartPolicy(),
    )
    refitter = Refitter(policy, gen, "ipc")
    yield policy, gen, refitter
    refitter.close()
    gen.shutdown()
    policy.shutdown()


def _noise(worker, std, seed):
    worker._add_noise_to_weights(std, seed)


def _perturb(policy, seed):
    g = policy.worker_group
    calls = [(r, (0.05, seed), {}) for r in range(g.world_size)]
    g.apply(_noise, calls, label="noise").wait(timeout=60)


def _prompts(tokenizer, n=6, seed=0):
    pairs = AdditionTask(seed).sample_prompts(n)
    ids, lengths = encode_prompts(tokenizer, [p for p, _ in pairs])
    return px.BatchedDataDict(input_ids=ids, input_lengths=lengths)


def _local_greedy(model_path, state, tokenizer, data):
    """Greedy decoding on a private model holding ``state`` (the expected output)."""
    worker = HFGenerationWorker(_gen_cfg(model_path), tokenizer)
    worker.model.load_state_dict(state)
    return worker.generate(data, greedy=True)


def _storage(worker):
    """(the /dev/shm files the model's tensors live in, how many tensors are private)."""
    return shm_files(worker.model.state_dict().values())


def _storages(gen):
    return gen.apply(_storage, [(r, (), {}) for r in range(gen.world_size)]).wait(timeout=60)


def _states_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow(
    reason="its module fixture starts a two-rank policy and two generation workers (34-37 s "
    "alone, 50-74 s beside the other test process)"
)
def test_refit_gives_generators_views_of_one_ring_buffer(setup, model_path, tokenizer):
    policy, gen, refitter = setup
    _perturb(policy, 1)
    result = refitter.refit()
    assert result is refitter.last_result
    assert result.applied == [0, 1]
    assert result.routes == {0: "shm_view", 1: "shm_view"}
    storages = _storages(gen)
    (path,) = storages[0][0]
    assert storages == [({path}, 0), ({path}, 0)]  # every tensor, one shared buffer
    assert path in refitter.sender.shared_buffers

    state = policy.state_dict()
    for sd in gen.get_state_dict().wait(60):
        assert _states_equal(sd, state)
    data = _prompts(tokenizer, seed=1)
    expected = _local_greedy(model_path, state, tokenizer, data)
    for out in gen.generate(data, greedy=True).wait(60):
        assert torch.equal(out["output_ids"], expected["output_ids"])
        torch.testing.assert_close(out["logprobs"], expected["logprobs"])


def test_repeated_refits_reuse_a_buffer_only_once_nobody_views_it(setup):
    policy, gen, refitter = setup
    paths = []
    for step in range(4):
        _perturb(policy, 100 + step)
        assert refitter.refit().routes == {0: "shm_view", 1: "shm_view"}
        (held,) = _storages(gen)[0][0]
        assert _storages(gen)[1] == ({held}, 0)
        paths.append(held)
    # Double-buffered: each version goes into the buffer nobody views any more.
    assert paths[0] != paths[1] and paths[2] == paths[0] and paths[3] == paths[1]
    assert sorted(refitter.sender.shared_buffers) == sorted(paths[:2])
    versions = gen.apply(_version, [(0, (), {}), (1, (), {})]).wait(timeout=30)
    assert versions == [refitter.sender.version] * 2


def _version(worker):
    return worker.weights_version


def _wait_file(path):
    assert until(lambda: os.path.exists(path), 60, 0.01), f"{path} never appeared"


def _generate_across_refit(worker, data, started, go):
    """Greedy-decode, signal, wait until the test says a refit is under way, decode again."""
    a = worker.generate(data, greedy=True)
    seen_a = _storage(worker)
    open(started, "w").close()
    _wait_file(go)
    b = worker.generate(data, greedy=True)
    return a, b, seen_a, _storage(worker)


def _wait_pending(sender):
    assert until(lambda: sender.pending, 60, 0.01), "the refit never reached its send"


def test_a_generator_busy_during_a_refit_finishes_on_its_version(
    setup, model_path, tokenizer, tmp_path
):
    policy, gen, refitter = setup
    _perturb(policy, 200)
    refitter.refit()
    old = policy.state_dict()
    data = _prompts(tokenizer, seed=2)
    expected_old = _local_greedy(model_path, old, tokenizer, data)
    started, go = str(tmp_path / "started"), str(tmp_path / "go")
    busy = gen.apply(_generate_across_refit, [(0, (data, started, go), {})])
    _wait_file(started)
    _perturb(policy, 201)
    outcome = {}
    t = threading.Thread(target=lambda: outcome.setdefault("result", refitter.refit()))
    t.start()
    _wait_pending(refitter.sender)  # the new version is written and being applied
    open(go, "w").close()
    a, b, seen_a, seen_b = busy.wait(timeout=120)[0]
    t.join(120)
    assert outcome["result"].routes == {0: "shm_view", 1: "shm_view"}
    # Both decodes of the call ran on the version it started with, from the same buffer.
    assert torch.equal(a["output_ids"], expected_old["output_ids"])
    assert torch.equal(b["output_ids"], a["output_ids"]) and torch.equal(
        b["logprobs"], a["logprobs"]
    )
    assert seen_a == seen_b and seen_a[1] == 0
    # Once the call ended, the generator switched to the new version.
    new = policy.state_dict()
    expected_new = _local_greedy(model_path, new, tokenizer, data)
    assert not torch.equal(expected_new["output_ids"], expected_old["output_ids"])
    after = gen.execute_on(0).generate(data, greedy=True).wait(60)[0]
    assert torch.equal(after["output_ids"], expected_new["output_ids"])
    assert _storages(gen)[0][0] != seen_a[0]


def _exit_when(worker, started, go):
    open(started, "w").close()
    _wait_file(go)
    os._exit(1)


def test_killed_generator_is_restarted_and_refitted(setup, model_path, tokenizer, tmp_path):
    import ray

    policy, gen, refitter = setup
    _perturb(policy, 300)
    refitter.refit()
    data = _prompts(tokenizer, seed=3)
    state = policy.state_dict()
    expected = _local_greedy(model_path, state, tokenizer, data)
    (held,) = _storages(gen)[1][0]
    restarts = gen.num_remote_worker_restarts()

    # Killed between refits: restarted, and its parameters view the newest buffer again.
    ray.kill(gen.actors[1], no_restart=True)
    # the group's monitor sees the death within milliseconds
    until(lambda: gen.health()[1] != px.WorkerHealth.HEALTHY, 30, 0.01)
    outs = gen.generate(data, greedy=True).wait(120)  # waits for the restart and its refit
    assert gen.num_remote_worker_restarts() == restarts + 1
    for out in outs:
        assert torch.equal(out["output_ids"], expected["output_ids"])
    assert _storages(gen)[1] == ({held}, 0)

    # Killed in a call while a refit is applied: the version's buffer, which it might
    # still have read, is retired (never rewritten); the restart gets that version from
    # the sender's mapping, and the next refit reaches everyone through a fresh buffer.
    started, go = str(tmp_path / "started"), str(tmp_path / "go")
    gen.apply(_exit_when, [(1, (started, go), {})])
    _wait_file(started)
    _perturb(policy, 301)
    errors = []

    def refit():
        try:
            refitter.refit()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=refit)
    t.start()
    _wait_pending(refitter.sender)
    (written,) = {b for b in refitter.sender.shared_buffers if b != held}
    open(go, "w").close()
    t.join(120)
    assert len(errors) == 1 and "worker died" in errors[0], errors
    assert written not in refitter.sender.shared_buffers  # retired
    state = policy.state_dict()
    assert until(lambda: gen.num_remote_worker_restarts() >= restarts + 2, 120, 0.05), (
        "rank 1 was not restarted"
    )
    assert gen.execute_on(1).is_alive().wait(120) == [True]  # restarted and restored
    assert gen.num_remote_worker_restarts() == restarts + 2
    for sd in gen.get_state_dict().wait(60):
        assert _states_equal(sd, state)

    _perturb(policy, 302)
    result = refitter.refit()
    assert result.routes == {0: "shm_view", 1: "shm_view"}
    storages = _storages(gen)
    (path,) = storages[0][0]
    assert storages[1] == ({path}, 0) and path != written
    expected = _local_greedy(model_path, policy.state_dict(), tokenizer, data)
    for out in gen.generate(data, greedy=True).wait(60):
        assert torch.equal(out["output_ids"], expected["output_ids"])


def test_two_policy_ranks_write_the_same_weights_as_one(
    cluster, setup, model_path, tokenizer, tmp_path
):
    """Each of dp=2 ranks writes its own FSDP rows; the ring buffer then holds exactly
    what a single rank writes for the same weights (loaded from the two ranks'
    checkpoint)."""
    policy, gen, refitter = setup
    _perturb(policy, 400)
    assert refitter.refit().routes == {0: "shm_view", 1: "shm_view"}
    two = gen.execute_on(0).get_state_dict().wait(60)[0]
    assert _states_equal(two, policy.state_dict())
    policy.save_checkpoint(str(tmp_path / "weights"))
    single = _policy(cluster, model_path, tokenizer, 1, "view_dp1")
    single_refitter = Refitter(single, gen, "ipc")
    try:
        single.load_checkpoint(str(tmp_path / "weights"))
        assert single_refitter.refit().routes == {0: "shm_view", 1: "shm_view"}
        one = gen.execute_on(0).get_state_dict().wait(60)[0]
    finally:
        single_refitter.close()
        single.shutdown()
    assert _states_equal(one, two)
