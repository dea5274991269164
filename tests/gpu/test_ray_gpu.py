"""The Ray-based GPU paths: a 1-GPU ``RayVirtualCluster(use_gpus=True)``, the policy
through ``Policy`` on it, a colocated generation group refitted by CUDA IPC through
``Refitter``, and GRPO on the tiny model for a few steps. Needs ``ray`` (install.sh)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import procs
from tests.gpu.skips import needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.ray_cluster, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def gpu_cluster():
    import phalanx as px

    cluster = px.Cluster(num_cpus=8, num_gpus=1)
    yield cluster
    cluster.shutdown()


def _hf_logprobs(model_path, data):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    out = torch.zeros(data["input_ids"].shape)
    out[:, 1:] = lp
    return out * (torch.arange(out.shape[1])[None] < data["input_lengths"][:, None])


def test_policy_and_colocated_generator_on_one_gpu(gpu_cluster, tiny_model, tiny_tokenizer):
    import phalanx as px
    from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts, sft_batch
    from phalanx.llm.loss import NLLLoss
    from phalanx.llm.refit import Refitter

    vc = px.RayVirtualCluster(
        [1], use_gpus=True, num_gpus_per_node=1, max_colocated_worker_groups=2, cluster=gpu_cluster
    )
    policy = px.Policy(vc, procs.policy_config(tiny_model), tiny_tokenizer, name_prefix="gpu_pol")
    gen = None
    try:
        (info,) = policy.worker_group.get_gpu_info().wait(60)
        assert info["cuda"] is True and info["memory_allocated_mb"] > 0
        data = sft_batch(tiny_tokenizer, AdditionTask(0).sample_prompts(8))
        lp = policy.get_logprobs(data)["logprobs"]
        torch.testing.assert_close(lp, _hf_logprobs(tiny_model, data), atol=1e-4, rtol=0)
        policy.train(data, NLLLoss())

        cfg = {"model_name": tiny_model, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0}
        gen = px.HFGenerationWorker.create_group(cfg, tiny_tokenizer).launch(vc, name="gpu_gen")
        refitter = Refitter(policy, gen, "ipc")
        refitter.refit()
        state = policy.state_dict()
        (got,) = gen.get_state_dict().wait(60)
        for k, v in state.items():
            assert torch.equal(got[k], v), k
        ids, lengths = encode_prompts(
            tiny_tokenizer, [p for p, _ in AdditionTask(2).sample_prompts(6)]
        )
        (out,) = gen.generate(
            px.BatchedDataDict(input_ids=ids, input_lengths=lengths), greedy=True
        ).wait(60)
        seqs = px.BatchedDataDict(
            input_ids=out["output_ids"], input_lengths=out["unpadded_sequence_lengths"]
        )
        policy_lp = policy.get_logprobs(seqs)["logprobs"]
        mask = out["logprobs"] != 0
        assert int(mask.sum()) > 0
        torch.testing.assert_close(out["logprobs"], policy_lp * mask, atol=1e-4, rtol=0)
        refitter.close()
    finally:
        if gen is not None:
            gen.shutdown()
        policy.shutdown()
        vc.shutdown()


def test_grpo_on_the_tiny_model_runs_on_cuda(gpu_cluster, tmp_path):
    from phalanx.algorithms.grpo import GRPOConfig, train

    cfg = GRPOConfig.tiny(
        run_dir=str(tmp_path / "grpo"),
        steps=3,
        warmup_steps=10,
        num_policy_workers=1,
        num_generation_workers=1,
        eval_every=0,
        progress=False,
    )
    result = train(cfg, gpu_cluster)
    history = result["history"]
    assert [row["step"] for row in history] == [1, 2, 3]
    assert all(row["time/step"] > 0 and 0.0 <= row["accuracy"] <= 1.0 for row in history)
