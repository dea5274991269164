"""Policy as a NeMo-RL user drives it: on a RayVirtualCluster, NeMo-RL's config keys,
dynamic batching and sequence packing, sequence-level losses without token_mask,
return_state_dict on one worker, get_gpu_info keys, cpu_offload on CPU (2 CPU ranks)."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from phalanx.data import BatchedDataDict
from phalanx.llm.loss import LossType, NLLLoss
from phalanx.llm.policy import Policy
from phalanx.llm.policy_config import ConfigError
from phalanx.resources.virtual_cluster import RayVirtualCluster

pytestmark = pytest.mark.timeout(420)

B, T = 8, 16


def _nemo_cfg(path, **over):
    """A config as NeMo-RL's DTensor worker tests write it (keys phalanx must accept)."""
    cfg = {
        "model_name": path,
        "tokenizer": {"name": path},
        "generation_batch_size": 1,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "learning_rate": 5e-6,
        "logprob_batch_size": 3,
        "precision": "float32",
        "offload_optimizer_for_logprob": False,
        "dtensor_cfg": {
            "enabled": True,
            "cpu_offload": False,
            "sequence_parallel": False,
            "activation_checkpointing": False,
            "tensor_parallel_size": 1,
            "context_parallel_size": 1,
            "custom_parallel_plan": None,
        },
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {"enabled": False},
        # SGD with lr 1 and no clipping: the weight change is exactly minus the gradient.
        "optimizer": {"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
        "max_grad_norm": None,
        "make_sequence_length_divisible_by": 1,
        "max_total_sequence_length": T,
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def _data(tokenizer) -> BatchedDataDict:
    """Right-padded random sequences of very different lengths (token_mask: all but the
    first token of each sequence)."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.tensor([16, 3, 11, 5, 14, 2, 8, 9])
    ids = torch.full((B, T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(3, len(tokenizer), (n,), generator=g)
        mask[i, 1:n] = 1
    return BatchedDataDict(
        input_ids=ids, input_lengths=lengths, token_mask=mask, sample_mask=torch.ones(B)
    )


def _hf_logprobs(model_path, data):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    out = torch.zeros(data["input_ids"].shape)
    out[:, 1:] = lp
    return out * (torch.arange(T)[None] < data["input_lengths"][:, None])


class MeanSequenceLogprobLoss:
    """A sequence-level loss that reads no token_mask: minus the mean over valid sequences
    of each sequence's summed log-prob over its first ``input_lengths`` tokens."""

    loss_type = LossType.SEQUENCE_LEVEL

    def __call__(self, logits, data, global_valid_seqs, global_valid_toks):
        ids = data["input_ids"]
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        pos = torch.arange(1, ids.shape[1], device=lp.device)[None]
        valid = (pos < data["input_lengths"][:, None].to(lp.device)).float()
        per_seq = (lp * valid).sum(-1) * data["sample_mask"].to(lp.device)
        loss = -per_seq.sum() / global_valid_seqs
        return loss, {"loss": loss.item(), "valid_toks": float(global_valid_toks)}


def _run(policy, data):
    """Log-probs, an eval loss, then one SGD step: what the three batching modes share."""
    lp = policy.get_logprobs(data)["logprobs"]
    ev = policy.train(data, NLLLoss(), eval_mode=True)["loss"]
    before = policy.state_dict()
    out = policy.train(data, NLLLoss())
    after = policy.state_dict()
    return lp, ev, out, {k: before[k] - after[k] for k in before}


@pytest.fixture(scope="module")
def vcluster(cluster):
    vc = RayVirtualCluster([2], use_gpus=False, name="nemo_face")
    yield vc
    vc.shutdown()


@pytest.fixture(scope="module")
def plain_run(vcluster, model_path, tokenizer):
    """A tp=1 policy on the virtual cluster; its NeMo-RL-face checks; the plain results."""
    data = _data(tokenizer)
    with pytest.warns(UserWarning, match="learning_rate"):
        policy = Policy(vcluster, _nemo_cfg(model_path), tokenizer, init_reference_model=False)
    try:
        g = policy.worker_group
        assert len(g.workers) == 2 and policy.dp_size == 2
        infos = ray.get([w.get_gpu_info.remote() for w in g.workers])
        assert [i["rank"] for i in infos] == [0, 1]
        assert [i["world_size"] for i in infos] == [2, 2]
        assert sorted(i["local_rank"] for i in infos) == [0, 1]
        assert [i["env_vars"]["WORLD_SIZE"] for i in infos] == ["2", "2"]
        names = [next(iter(i["parameter_sample"])) for i in infos]
        assert names[0] == names[1]
        assert infos[0]["parameter_sample"][names[0]]["device"] == "cpu"
        assert infos[0]["memory_allocated_mb"] > 10

        # return_state_dict on ONE worker: NeMo-RL's sharded state dict, no collective.
        t0 = time.monotonic()
        sd = ray.get(g.workers[0].return_state_dict.remote(), timeout=60)
        assert time.monotonic() - t0 < 30
        w = sd["model.embed_tokens.weight"]
        assert w.shape[0] == 2 * w.to_local().shape[0] and w.shape[1] == w.to_local().shape[1]

        # A sequence-level loss needs no token_mask; eval_mode computes it without a step.
        no_mask = BatchedDataDict({k: v for k, v in data.items() if k != "token_mask"})
        seq_loss = policy.train(no_mask, MeanSequenceLogprobLoss(), eval_mode=True)
        lp_hf = _hf_logprobs(model_path, data)
        torch.testing.assert_close(
            seq_loss["loss"], torch.tensor([-lp_hf.sum() / B]), atol=1e-4, rtol=1e-5
        )
        # every token of every sequence counts as valid without token_mask (NeMo-RL)
        assert seq_loss["all_mb_metrics"]["valid_toks"] == [B * T] * 4
        with pytest.raises(Exception, match="token_mask"):
            policy.train(no_mask, NLLLoss())
        policy.prepare_for_training()
        results = _run(policy, data)
        policy.finish_training()
        return data, lp_hf, results
    finally:
        policy.shutdown()


def test_plain_policy_on_virtual_cluster_matches_hf(plain_run) -> None:
    data, lp_hf, (lp, ev, out, delta) = plain_run
    torch.testing.assert_close(lp, lp_hf, atol=1e-5, rtol=1e-4)
    mask = data["token_mask"][:, 1:]
    expected = -(lp_hf[:, 1:] * mask).sum() / mask.sum()
    torch.testing.assert_close(ev, expected.reshape(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss"], ev, atol=1e-5, rtol=1e-5)
    assert float(out["grad_norm"][0]) > 0


def _assert_same_as_plain(plain_run, results) -> None:
    _, _, (lp0, ev0, out0, delta0) = plain_run
    lp, ev, out, delta = results
    torch.testing.assert_close(lp, lp0, atol=1e-5, rtol=1e-4)  # also: the caller's order
    torch.testing.assert_close(ev, ev0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["loss"], out0["loss"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["grad_norm"], out0["grad_norm"], atol=1e-5, rtol=1e-4)
    for k in delta0:
        torch.testing.assert_close(delta[k], delta0[k], atol=1e-6, rtol=1e-4, msg=k)


def test_dynamic_batching_tp2_custom_plan_on_virtual_cluster_equals_plain(
    plain_run, vcluster, model_path, tokenizer
) -> None:
    # tp=2 with a custom plan named by dotted path (it also shards lm_head)
    plan = "tests.llm.parallel_plans.llama_tp_plan"
    cfg = _nemo_cfg(
        model_path,
        dtensor_cfg={"tensor_parallel_size": 2, "custom_parallel_plan": plan},
        dynamic_batching={
            "enabled": True,
            "train_mb_tokens": 40,
            "logprob_mb_tokens": 40,
            "sequence_length_round": 4,
        },
    )
    with pytest.warns(UserWarning, match="learning_rate"):
        policy = Policy(vcluster, cfg, tokenizer, name_prefix="nemo_dyn_tp2")
    try:
        assert policy.dp_size == 1 and len(policy.worker_group.workers) == 2
        sd = ray.get(policy.worker_group.workers[1].return_state_dict.remote(), timeout=60)
        head = sd["lm_head.weight"]  # [vocab, hidden] split over the vocabulary by the plan
        assert head.shape[0] == 2 * head.to_local().shape[0]
        assert sd["model.norm.weight"].to_local().shape == sd["model.norm.weight"].shape
        data = plain_run[0]
        # the worker really cuts micro-batches by tokens: 8 rows in more than one pass
        shards, _ = data.shard_by_batch_size(
            1,
            dynamic_batching_args={
                "input_key": "input_ids",
                "input_lengths_key": "input_lengths",
                "sequence_length_round": 4,
                "max_tokens_per_microbatch": 40,
            },
        )
        assert shards[0].get_microbatch_iterator_dynamic_shapes_len() > 2
        _assert_same_as_plain(plain_run, _run(policy, data))
    finally:
        policy.shutdown()


@pytest.mark.parametrize("order", ["packer", "largest_first"])
def test_sequence_packing_with_cpu_offload_equals_plain(
    plain_run, cluster, model_path, tokenizer, order
) -> None:
    # Also NeMo-RL keys that must not change the result here: a SequentialLR of two
    # constant schedules, gradient sync on every micro-batch, cache clearing, a no-op
    # config override and NeMo-RL's refit buffer size.
    constant = {"name": "torch.optim.lr_scheduler.ConstantLR", "kwargs": {"factor": 1.0}}
    cfg = _nemo_cfg(
        model_path,
        dtensor_cfg={
            "cpu_offload": True,
            "defer_fsdp_grad_sync": False,
            "clear_cache_every_n_steps": 1,
        },
        scheduler=[constant, constant, {"milestones": [1]}],
        hf_config_overrides={"rms_norm_eps": 1e-6},
        refit_buffer_size_gb=0.01,
        sequence_packing={
            "enabled": True,
            "train_mb_tokens": 24,
            "logprob_mb_tokens": 32,
            "algorithm": "modified_first_fit_decreasing",
            "microbatch_order": order,
        },
    )
    # cpu_offload on a CPU-only machine starts and trains (the worker warns that it
    # changes nothing there)
    with pytest.warns(UserWarning, match="learning_rate"):
        policy = Policy(cluster, cfg, tokenizer, name_prefix=f"nemo_pack_{order}", num_workers=2)
    try:
        results = _run(policy, plain_run[0])
        _assert_same_as_plain(plain_run, results)
        assert results[2]["lr"] == 1.0
    finally:
        policy.shutdown()


def test_config_errors_name_the_key_before_any_worker_starts(
    cluster, model_path, tokenizer
) -> None:
    cases = [
        ({"trian_micro_batch_size": 2}, "trian_micro_batch_size"),
        ({"dtensor_cfg": {"cpu_ofload": True}}, "cpu_ofload"),
        (
            {"sequence_packing": {"enabled": True, "train_mb_tokens": 32, "microbatch_order": "x"}},
            "microbatch_order",
        ),
        ({"dynamic_batching": {"enabled": True, "train_mb_tokens": 8}}, "sequence_length_round"),
        ({"megatron_cfg": {"enabled": True}}, "megatron_cfg"),
        (
            {"dtensor_cfg": {"lora_cfg": {"enabled": True, "target_modules": ["q_prj"]}}},
            "lora_cfg.target_modules: 'q_prj' matches no linear layer",
        ),
        ({"dtensor_cfg": {"tensor_parallel_size": 4}}, "tensor_parallel_size=4"),
        ({"dtensor_cfg": {"custom_parallel_plan": 3}}, "custom_parallel_plan"),
    ]
    # parallel sizes are checked against the number of ranks (a virtual cluster's bundles)
    tp2 = _nemo_cfg(model_path, dtensor_cfg={"tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 .* the 3 policy ranks"):
        Policy(cluster, tp2, tokenizer, num_workers=3)
    bad_plan = {"dtensor_cfg": {"custom_parallel_plan": "tests.llm.parallel_plans.nope"}}
    with pytest.raises(ValueError, match="cannot import 'tests.llm.parallel_plans.nope'"):
        Policy(cluster, _nemo_cfg(model_path, **bad_plan), tokenizer, num_workers=2)
    for over, match in cases:
        with pytest.raises(ConfigError, match=match) as info:
            Policy(cluster, _nemo_cfg(model_path, **over), tokenizer, num_workers=2)
        # NeMo-RL raises AssertionError for most of these; both catches work
        assert isinstance(info.value, AssertionError) and isinstance(info.value, ValueError)
    both = _nemo_cfg(
        model_path,
        dynamic_batching={"enabled": True, "train_mb_tokens": 8, "sequence_length_round": 1},
        sequence_packing={"enabled": True, "train_mb_tokens": 8},
    )
    with pytest.raises(AssertionError, match="exclusive"):
        Policy(cluster, both, tokenizer, num_workers=2)
