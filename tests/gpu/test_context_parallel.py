"""Context parallelism on CUDA.

With one GPU the ``cp`` mesh has one rank: the policy's context-parallel context
(``create_context_parallel_ctx`` inside ``train_context``) still swaps SDPA for torch's
ring attention, whose logits must equal the plain forward. ``context_parallel_size=2``
needs two GPUs (one NCCL rank each) and is skipped below that.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import procs
from tests.gpu.skips import skip_unless

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@skip_unless(1)
def test_context_parallel_ctx_of_one_rank_equals_the_plain_forward(rank0_env, tiny_model):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from phalanx.llm.parallelize import use_cp_attention
    from phalanx.llm.policy_worker import DTensorPolicyWorker

    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model, dtype=torch.float32, attn_implementation="sdpa"
        ).cuda()
        model.eval()
        ids = torch.randint(4, 40, (3, 18), generator=torch.Generator().manual_seed(0)).cuda()
        pos = torch.arange(18, device="cuda").expand(3, -1).contiguous()
        with torch.no_grad():
            plain = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            use_cp_attention(model)  # as the policy worker does with context_parallel_size > 1
            ctx = DTensorPolicyWorker.create_context_parallel_ctx(
                mesh, [ids, pos], [1, 1], {ids, pos}
            )
            with DTensorPolicyWorker.train_context(ctx):
                ring = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        torch.testing.assert_close(ring, plain, atol=1e-4, rtol=1e-4)
    finally:
        dist.destroy_process_group()


@skip_unless(2)
@pytest.mark.ray_cluster
def test_context_parallel_two_ranks_equals_one(tiny_model, tiny_tokenizer):
    import phalanx as px
    from phalanx.algorithms.grpo_tiny_task import AdditionTask, sft_batch

    data = sft_batch(tiny_tokenizer, AdditionTask(0).sample_prompts(8))
    cluster = px.Cluster(num_cpus=8, num_gpus=2)
    results = {}
    try:
        for cp in (1, 2):
            vc = px.RayVirtualCluster([2], use_gpus=True, num_gpus_per_node=2, cluster=cluster)
            cfg = procs.policy_config(tiny_model, dtensor_cfg={"context_parallel_size": cp})
            policy = px.Policy(vc, cfg, tiny_tokenizer, name_prefix=f"cp{cp}")
            try:
                results[cp] = policy.get_logprobs(data)["logprobs"]
            finally:
                policy.shutdown()
                vc.shutdown()
    finally:
        cluster.shutdown()
    torch.testing.assert_close(results[2], results[1], atol=1e-4, rtol=0)
