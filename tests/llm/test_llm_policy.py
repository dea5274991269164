"""DTensorPolicyWorker and Policy on 2 CPU ranks (gloo) with a tiny Llama."""

from __future__ import annotations

import os

import pytest
import torch

from phalanx.algorithms.grpo_tiny_task import AdditionTask, sft_batch
from phalanx.data import BatchedDataDict
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy import Policy

pytestmark = pytest.mark.timeout(240)


def _cfg(path, **over):
    cfg = {
        "model_name": path,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 4,
        "max_total_sequence_length": 32,
        "max_grad_norm": 1.0,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 3e-3}},
    }
    cfg.update(over)
    return cfg


def _data(tokenizer, n=16, seed=0):
    return sft_batch(tokenizer, AdditionTask(seed).sample_prompts(n))


def _hf_logprobs(model_path, data):
    from transformers import AutoModelForCausalLM

    return model_logprobs(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), data
    )


def model_logprobs(model, data):
    """Per-token log-probs of ``data`` under a plain (unsharded) model, as the policy's."""
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    out = torch.zeros(data["input_ids"].shape)
    out[:, 1:] = lp
    pos = torch.arange(out.shape[1])[None]
    return out * (pos < data["input_lengths"][:, None])


@pytest.fixture(scope="module")
def policy2(cluster, model_path, tokenizer):
    policy = Policy(cluster, _cfg(model_path), tokenizer, num_workers=2, name_prefix="pol2")
    yield policy
    policy.shutdown()


@pytest.mark.smoke
def test_logprobs_match_hf_then_training_lowers_loss_and_keeps_reference(
    policy2, model_path, tokenizer
):
    data = _data(tokenizer)
    expected = _hf_logprobs(model_path, data)
    lp = policy2.get_logprobs(data)["logprobs"]
    assert lp.shape == data["input_ids"].shape
    assert torch.all(lp[:, 0] == 0)
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-4)
    ref_before = policy2.get_reference_policy_logprobs(data)["reference_logprobs"]
    torch.testing.assert_close(ref_before, expected, atol=1e-5, rtol=1e-4)

    losses = [float(policy2.train(data, NLLLoss())["loss"].mean()) for _ in range(6)]
    assert losses[-1] < losses[0] * 0.8, losses
    # The reference weights are untouched by training; the current ones moved.
    ref_after = policy2.get_reference_policy_logprobs(data)["reference_logprobs"]
    torch.testing.assert_close(ref_after, ref_before, atol=1e-6, rtol=0)
    lp_after = policy2.get_logprobs(data)["logprobs"]
    assert not torch.allclose(lp_after, lp, atol=1e-3)
    # ...and swapping the reference in and out left the current weights as they were.
    torch.testing.assert_close(policy2.get_logprobs(data)["logprobs"], lp_after, atol=0, rtol=0)

    # eval_mode computes the loss without stepping.
    ev1 = policy2.train(data, NLLLoss(), eval_mode=True)["loss"]
    ev2 = policy2.train(data, NLLLoss(), eval_mode=True)["loss"]
    torch.testing.assert_close(ev1, ev2)


def test_one_and_two_ranks_give_same_loss_and_gradients(cluster, model_path, tokenizer):
    # SGD with lr 1 and no clipping: the weight change is exactly minus the gradient.
    cfg = _cfg(
        model_path,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}},
    )
    data = _data(tokenizer, n=8, seed=3)
    # Uneven answer lengths: ranks hold different numbers of valid tokens.
    data["token_mask"][0, :] = 0
    data["token_mask"][0, 5] = 1
    results = {}
    for n in (1, 2):
        pol = Policy(cluster, cfg, tokenizer, num_workers=n, name_prefix=f"sgd{n}")
        try:
            before = pol.state_dict()
            out = pol.train(data, NLLLoss(), mbs=1 if n == 2 else 2)
            after = pol.state_dict()
        finally:
            pol.shutdown()
        results[n] = (out, {k: before[k] - after[k] for k in before})
    (o1, g1), (o2, g2) = results[1], results[2]
    torch.testing.assert_close(o1["loss"], o2["loss"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o1["grad_norm"], o2["grad_norm"], atol=1e-5, rtol=1e-4)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], atol=1e-6, rtol=1e-4, msg=k)
    assert float(o1["grad_norm"][0]) > 0


def test_checkpoint_resume_is_exact(cluster, policy2, model_path, tokenizer, tmp_path):
    data = _data(tokenizer, seed=5)
    policy2.train(data, NLLLoss())
    w, o, t = (str(tmp_path / x) for x in ("weights", "optim", "tok"))
    policy2.save_checkpoint(w, o, t)
    assert os.path.exists(os.path.join(t, "tokenizer_config.json"))
    lp_saved = policy2.get_logprobs(data)["logprobs"]
    resumed = Policy(
        cluster,
        _cfg(model_path),
        tokenizer,
        num_workers=2,
        name_prefix="resumed",
        weights_path=w,
        optimizer_path=o,
    )
    try:
        torch.testing.assert_close(resumed.get_logprobs(data)["logprobs"], lp_saved, atol=0, rtol=0)
        next_a = policy2.train(data, NLLLoss())
        next_b = resumed.train(data, NLLLoss())
        torch.testing.assert_close(next_a["loss"], next_b["loss"], atol=0, rtol=0)
        torch.testing.assert_close(next_a["grad_norm"], next_b["grad_norm"], atol=0, rtol=0)
        torch.testing.assert_close(
            policy2.get_logprobs(data)["logprobs"],
            resumed.get_logprobs(data)["logprobs"],
            atol=0,
            rtol=0,
        )
    finally:
        resumed.shutdown()


def _unsharded_numel(worker):
    from phalanx.llm.policy_worker import get_cpu_state_dict, unshard_fsdp2_model

    local = sum(v.numel() for v in get_cpu_state_dict(worker.model.state_dict().items()).values())
    with unshard_fsdp2_model(worker.model):
        full = sum(p.numel() for p in worker.model.parameters())
    return local, full


def test_seed_methods_memory_moves_and_profiling(policy2, tokenizer, tmp_path):
    g = policy2.worker_group
    assert g.is_alive().wait(30) == [True, True]
    info = g.get_gpu_info().wait(30)
    assert [i["rank"] for i in info] == [0, 1] and info[0]["cuda"] is False
    assert all(d.startswith("cpu:") for d in g.report_device_id().wait(30))
    g.reset_peak_memory_stats().wait(30)
    # Sharded: each rank holds about half; unsharded: the whole model.
    (l0, f0), (l1, f1) = g.apply(
        _unsharded_numel, [(0, (), {}), (1, (), {})], label="_unsharded_numel"
    ).wait(timeout=60)
    assert f0 == f1 and l0 + l1 == f0 and l0 < f0
    data = _data(tokenizer, n=6)
    lp = policy2.get_logprobs(data)["logprobs"]
    policy2.prepare_for_lp_inference()
    torch.testing.assert_close(policy2.get_logprobs(data)["logprobs"], lp, atol=0, rtol=0)
    (info, free), _ = g.prepare_weights_for_ipc().wait(30)  # collective: every rank gathers
    names = [n for n, _ in info]
    assert "model.embed_tokens.weight" in names and all(b > 0 for _, b in info) and free > 0
    policy2.offload_after_refit()
    policy2.prepare_for_training()
    torch.testing.assert_close(policy2.get_logprobs(data)["logprobs"], lp, atol=0, rtol=0)
    with pytest.raises(Exception, match="CUDA is not available"):
        g.apply(lambda w: w.move_to_cuda(w.model), [(0, (), {})], label="x").wait(timeout=30)
    # Noise changes the weights (and so the log-probs).
    g.apply(
        lambda w: w._add_noise_to_weights(0.05), [(0, (), {}), (1, (), {})], label="noise"
    ).wait(timeout=30)
    assert not torch.allclose(policy2.get_logprobs(data)["logprobs"], lp, atol=1e-3)
    # Profiling writes a Chrome trace.
    g.start_gpu_profiling().wait(30)
    policy2.get_logprobs(data)
    paths = g.stop_gpu_profiling().wait(30)
    assert all(os.path.getsize(p) > 0 for p in paths)
    assert (
        "DTensorPolicyWorker[rank=1]" in g.apply(repr, [(1, (), {})], label="r").wait(timeout=30)[0]
    )


def test_bad_input_names_the_value(cluster, policy2, model_path, tokenizer):
    with pytest.raises(ValueError, match="does-not-exist"):
        Policy(cluster, _cfg("/tmp/does-not-exist"), tokenizer, num_workers=2)
    no_pad = type(tokenizer).from_pretrained(model_path)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="pad token"):
        Policy(cluster, _cfg(model_path), no_pad, num_workers=2)
    with pytest.raises(ValueError, match="train_global_batch_size 7"):
        Policy(cluster, _cfg(model_path, train_global_batch_size=7), tokenizer, num_workers=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 .*num_attention_heads=4"):
        from phalanx.llm.policy_worker import _check_config

        _check_config(_cfg(model_path, dtensor_cfg={"tensor_parallel_size": 3}))
    data = _data(tokenizer)
    with pytest.raises(ValueError, match="gbs 5 is not divisible"):
        policy2.train(data, NLLLoss(), gbs=5)
    with pytest.raises(ValueError, match="mbs 3"):
        policy2.train(data, NLLLoss(), mbs=3)
    long = BatchedDataDict(
        input_ids=torch.ones((2, 40), dtype=torch.long),
        input_lengths=torch.tensor([40, 40]),
        token_mask=torch.ones((2, 40)),
    )
    with pytest.raises(ValueError, match="sequence length 40"):
        policy2.get_logprobs(long)
    # The worker checks too (a caller going around Policy).
    g = policy2.worker_group
    with pytest.raises(Exception, match="sequence length 40"):
        g.execute_on(0).get_logprobs(long).wait(30)


def _pack_uneven(worker, name):
    """FSDP2-shard a module with row counts that do not split evenly; pack it by rows."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from phalanx.llm.refit_stream import stream_layout, write_shards
    from phalanx.weights import ShmSegment

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1), torch.nn.Embedding(7, 3))
    full = {k: v.clone() for k, v in m.state_dict().items()}
    fully_shard(m, mesh=worker.dp_mesh)
    state = m.state_dict()
    layout = stream_layout(state, torch.float32)
    if worker.rank == 0:
        seg = ShmSegment(layout.total_bytes, name=name)
    dist.barrier()
    if worker.rank != 0:
        seg = ShmSegment(layout.total_bytes, name=name, create=False)
    write_shards(seg.tensor, layout, state, worker.rank == 0)
    dist.barrier()
    return layout, full


def test_ranks_pack_their_own_uneven_rows(policy2):
    from phalanx.weights import ShmSegment, views

    name = f"phalanx_test_{os.getpid()}"
    g = policy2.worker_group
    try:
        results = g.apply(_pack_uneven, [(r, (name,), {}) for r in (0, 1)], label="pack").wait(
            timeout=60
        )
        (layout, full), _ = results
        got = views(ShmSegment(layout.total_bytes, name=name, create=False).tensor, layout)
        for k, v in full.items():
            assert torch.equal(got[k], v), k
    finally:
        ShmSegment(1, name=name, create=False).unlink()
