"""Refit by CUDA IPC from the policy to a generation worker on the same GPU (NeMo-RL's
colocated case), without Ray: the policy lives in the test process, the generator in a
spawned one; the seed methods ``prepare_weights_for_ipc`` / ``get_weights_ipc_handles``
hand the weights over, ``update_weights_from_ipc_handles`` takes them."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import procs
from tests.gpu.skips import needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(300)]


def _prompts(tokenizer, n=6, seed=0):
    import phalanx as px
    from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts

    ids, lengths = encode_prompts(tokenizer, [p for p, _ in AdditionTask(seed).sample_prompts(n)])
    return px.BatchedDataDict(input_ids=ids, input_lengths=lengths)


def _generated_logprobs_under_policy(worker, out):
    """The policy's log-probs of the generated tokens, where the generator reported its own."""
    import phalanx as px

    ids = out["output_ids"]
    lengths = out["unpadded_sequence_lengths"]
    lp = worker.get_logprobs(px.BatchedDataDict(input_ids=ids, input_lengths=lengths))["logprobs"]
    mask = out["logprobs"] != 0
    return lp * mask, mask


def test_generator_refitted_by_cuda_ipc_matches_the_policy(rank0_env, tiny_model, tiny_tokenizer):
    import phalanx as px
    from phalanx.algorithms.grpo_tiny_task import AdditionTask, sft_batch
    from phalanx.llm.loss import NLLLoss

    prompts = _prompts(tiny_tokenizer)
    in_q, out_q = procs.queues(2)
    gen = procs.start(procs.generation_receiver, in_q, out_q, tiny_model, prompts)
    worker = px.DTensorPolicyWorker(procs.policy_config(tiny_model), tiny_tokenizer)
    try:
        data = sft_batch(tiny_tokenizer, AdditionTask(1).sample_prompts(8))
        previous = None
        for version in range(2):
            worker.train(data, NLLLoss())
            worker.offload_before_refit()
            info, _ = worker.prepare_weights_for_ipc()
            handles = worker.get_weights_ipc_handles([k for k, _ in info])
            (device_id,) = handles
            assert device_id == worker.report_device_id()
            assert handles[device_id]["kind"] == "cuda_ipc"
            in_q.put(handles)
            got = procs.get_by_value(out_q, 240)
            assert got["device"] == "cuda:0"
            full = worker.return_full_state_dict()
            assert set(got["state"]) == set(full)
            for k, v in full.items():
                assert torch.equal(got["state"][k], v), (version, k)
            if previous is not None:  # the second version replaced the first
                assert any(not torch.equal(got["state"][k], previous[k]) for k in full)
            previous = full
            worker.offload_after_refit()
            worker.prepare_for_training()
            out = got["out"]
            policy_lp, mask = _generated_logprobs_under_policy(worker, out)
            assert int(mask.sum()) > 0
            torch.testing.assert_close(out["logprobs"], policy_lp, atol=1e-4, rtol=0)
        in_q.put(None)
        gen.join(60)
        assert gen.exitcode == 0
    finally:
        worker.shutdown()
        if gen.is_alive():
            gen.kill()


def test_refits_reuse_one_cuda_buffer_until_the_layout_changes(
    rank0_env, tiny_model, tiny_tokenizer
):
    import phalanx as px

    in_q, out_q = procs.queues(2)
    gen = procs.start(procs.generation_receiver, in_q, out_q, tiny_model, _prompts(tiny_tokenizer))
    worker = px.DTensorPolicyWorker(
        procs.policy_config(tiny_model), tiny_tokenizer, init_optimizer=False
    )

    def refit(keys=None):
        info, _ = worker.prepare_weights_for_ipc()
        handles = worker.get_weights_ipc_handles(keys or [k for k, _ in info])
        in_q.put(handles)
        (handle,) = handles.values()
        return handle, procs.get_by_value(out_q, 240)

    try:
        sent, got = [], []
        for seed in (1, 2):
            worker._add_noise_to_weights(0.05, seed)
            handle, report = refit()
            sent.append(handle)
            got.append(report)
            full = worker.return_full_state_dict()
            for k, v in full.items():
                assert torch.equal(report["state"][k], v), (seed, k)
        assert sent[0]["kind"] == "cuda_ipc" and sent[1] is sent[0]
        assert got[1]["same_mapping"] is True  # the generator opened the handle once
        assert got[1]["mapped_ptr"] == got[0]["mapped_ptr"]
        assert worker._refit._ipc_buffer.allocations == 1

        by_size = sorted(sent[0]["layout"].specs, key=lambda s: s.nbytes)
        keep = [s.name for s in by_size[1:]]  # another layout: a new buffer
        worker._add_noise_to_weights(0.05, 3)
        handle, report = refit(keep)
        assert handle["buffer"] != sent[0]["buffer"]
        assert worker._refit._ipc_buffer.allocations == 2
        assert report["same_mapping"] is False
        full = worker.return_full_state_dict()
        for k in keep:
            assert torch.equal(report["state"][k], full[k]), k
        in_q.put(None)
        gen.join(60)
        assert gen.exitcode == 0
    finally:
        worker.shutdown()
        if gen.is_alive():
            gen.kill()
