"""Tensor and sequence parallelism of the policy worker on 2 CPU ranks (gloo), tiny Llama.

tp=2 (dp=1) must compute what one unsharded rank computes: the same log-probs, the same
loss and the same SGD update; refit from it must give the generator the same greedy
output; its checkpoint must load into a differently sharded (dp=2) policy.
"""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts, sft_batch
from phalanx.llm.generation import HFGenerationWorker
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy import Policy
from phalanx.llm.policy_worker import DTensorPolicyWorker, check_parallel_config
from phalanx.llm.refit import Refitter
from tests.llm.test_generation import _gen_cfg, _local_greedy

pytestmark = pytest.mark.timeout(420)  # three policies on a shared 2-core machine


def _cfg(path, **dtensor):
    # SGD with lr 1 and no clipping: the weight change is exactly minus the gradient.
    return {
        "model_name": path,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 4,
        "logprob_batch_size": 4,
        "max_total_sequence_length": 32,
        "max_grad_norm": None,
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        "dtensor_cfg": dtensor,
    }


def _run(policy, data):
    """Log-probs, then one SGD step: (log-probs, loss, weight change, weights after)."""
    lp = policy.get_logprobs(data)["logprobs"]
    before = policy.state_dict()
    out = policy.train(data, NLLLoss())
    after = policy.state_dict()
    return lp, out, {k: before[k] - after[k] for k in before}, after


@pytest.fixture(scope="module")
def unsharded(cluster, model_path, tokenizer):
    data = sft_batch(tokenizer, AdditionTask(3).sample_prompts(8))
    # An odd length (one more pad column): sequence parallelism pads it to a multiple of tp.
    B = data.size
    data["input_ids"] = torch.cat(
        [data["input_ids"], torch.full((B, 1), tokenizer.pad_token_id)], dim=1
    )
    data["token_mask"] = torch.cat([data["token_mask"], torch.zeros(B, 1)], dim=1)
    assert data["input_ids"].shape[1] % 2 == 1
    pol = Policy(cluster, _cfg(model_path), tokenizer, num_workers=1, name_prefix="tp_ref")
    try:
        return data, _run(pol, data)
    finally:
        pol.shutdown()


@pytest.mark.slow(
    reason="a two-rank tensor-parallel policy and a generator start (and, once, the one-rank reference run)"
)
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_matches_one_rank_and_refits_generator(
    cluster, model_path, tokenizer, unsharded, sequence_parallel, tmp_path
):
    data, (lp1, out1, delta1, _) = unsharded
    # The sequence-parallel run also recomputes activations (activation checkpointing).
    cfg = _cfg(
        model_path,
        tensor_parallel_size=2,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=sequence_parallel,
    )
    pol = Policy(cluster, cfg, tokenizer, num_workers=2, name_prefix=f"tp2_sp{sequence_parallel}")
    gen = None
    try:
        assert pol.dp_size == 1
        # Each tp rank holds half of every attention/MLP projection.
        g = pol.worker_group
        shapes = g.apply(_local_shapes, [(0, (), {})], label="shapes").wait(timeout=60)[0]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 64)
        lp2, out2, delta2, after = _run(pol, data)
        torch.testing.assert_close(lp2, lp1, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(out2["loss"], out1["loss"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out2["grad_norm"], out1["grad_norm"], atol=1e-5, rtol=1e-4)
        for k in delta1:
            torch.testing.assert_close(delta2[k], delta1[k], atol=1e-6, rtol=1e-4, msg=k)
        # A training step lowers the loss.
        assert float(pol.train(data, NLLLoss(), eval_mode=True)["loss"]) < float(out2["loss"])

        if sequence_parallel:  # one refit check covers both layouts' full_tensor path
            gen = HFGenerationWorker.create_group(_gen_cfg(model_path), tokenizer).launch(
                cluster, px.NodePlacement(num_workers=1), name="tp_gen"
            )
            Refitter(pol, gen, "ipc").refit()
            ids, lengths = encode_prompts(
                tokenizer, [p for p, _ in AdditionTask(9).sample_prompts(6)]
            )
            prompts = px.BatchedDataDict(input_ids=ids, input_lengths=lengths)
            expected = _local_greedy(model_path, after, tokenizer, prompts, max_new=6)
            got = gen.execute_on(0).generate(prompts, greedy=True).wait(60)[0]
            assert torch.equal(got["output_ids"], expected["output_ids"])
        else:  # the tp=2 checkpoint loads into a dp=2 policy with identical log-probs
            w = str(tmp_path / "weights")
            pol.save_checkpoint(w)
            lp_saved = pol.get_logprobs(data)["logprobs"]
            dp2 = Policy(cluster, _cfg(model_path), tokenizer, num_workers=2, name_prefix="tp_dp2")
            try:
                dp2.load_checkpoint(w)
                torch.testing.assert_close(
                    dp2.get_logprobs(data)["logprobs"], lp_saved, atol=1e-6, rtol=1e-5
                )
            finally:
                dp2.shutdown()
    finally:
        if gen is not None:
            gen.shutdown()
        pol.shutdown()


def _local_shapes(worker):
    return {k: tuple(v.to_local().shape) for k, v in worker.model.state_dict().items()}


def test_parallel_config_errors_name_the_value(cluster, model_path, tokenizer):
    def cfg(**d):
        return _cfg(model_path, **d)

    # The tiny model has 4 attention heads and 2 key/value heads.
    with pytest.raises(ValueError, match="tensor_parallel_size=3 .*num_attention_heads=4"):
        check_parallel_config(cfg(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=4 .*num_key_value_heads=2"):
        check_parallel_config(cfg(tensor_parallel_size=4))
    # As NeMo-RL: sequence parallelism without tensor parallelism warns and does nothing.
    with pytest.warns(UserWarning, match="sequence_parallel=True has no effect"):
        assert check_parallel_config(cfg(sequence_parallel=True)) == (1, 1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
        check_parallel_config(cfg(tensor_parallel_size=0))
    # Context parallelism needs CUDA: refused on the driver, before any worker starts.
    with pytest.raises(NotImplementedError, match="context_parallel_size=2.*CUDA"):
        Policy(cluster, cfg(context_parallel_size=2), tokenizer, num_workers=2)
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=2 x context_parallel_size=1 does not divide the 3 policy ranks",
    ):
        Policy(cluster, cfg(tensor_parallel_size=2), tokenizer, num_workers=3)


def _cp_on_cpu(store_path):
    """In a fresh 1-rank gloo process: what train_context does with and without a CP ctx."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    try:
        q = torch.randn(1, 2, 4, 8)
        expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        with DTensorPolicyWorker.train_context(None):  # no CP: an ordinary block
            plain = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        ctx = DTensorPolicyWorker.create_context_parallel_ctx(mesh, [q], [2], set())
        error = None
        try:
            with DTensorPolicyWorker.train_context(ctx):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        except NotImplementedError as e:
            error = str(e)
        # the failed block left SDPA as it was: a plain call after it works
        after = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return torch.equal(plain, expected) and torch.equal(after, expected), error
    finally:
        dist.destroy_process_group()


def test_train_context_and_context_parallel_ctx_on_cpu(cluster, tmp_path):
    import ray

    same, error = ray.get(
        ray.remote(num_cpus=1)(_cp_on_cpu).remote(str(tmp_path / "store")), timeout=120
    )
    assert same
    # Inside a real context-parallel context, CPU attention has no sharded kernel: the
    # reason check_parallel_config refuses context_parallel_size > 1 without CUDA.
    assert error is not None and "sharding strategy" in error, error


def test_cp_attention_equals_sdpa_with_and_without_a_mask(model_path):
    """The attention context parallelism runs (grouped-query heads repeated before SDPA,
    since its fused kernels need equal head counts) gives the logits of HF's "sdpa"."""
    from transformers import AutoModelForCausalLM

    from phalanx.llm.parallelize import CP_ATTENTION, use_cp_attention

    def load():
        return AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()

    plain, cp = load(), load()
    use_cp_attention(cp)
    assert cp.config._attn_implementation == CP_ATTENTION
    assert cp.config.num_attention_heads > cp.config.num_key_value_heads  # GQA is exercised
    ids = torch.randint(4, 40, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: HF builds a mask, which takes SDPA's own path
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            want = plain(input_ids=ids, use_cache=False, **kwargs).logits
            got = cp(input_ids=ids, use_cache=False, **kwargs).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
