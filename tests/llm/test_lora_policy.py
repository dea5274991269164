"""LoRA through Policy and the DTensor policy worker (2 CPU ranks, gloo, FSDP2): only
adapters train, the reference policy is the base model, refit sends merged weights under
the base model's names, and checkpoints hold the adapters in peft's format."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from phalanx.llm.lora import is_adapter_parameter
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy import Policy
from tests.llm.test_llm_policy import _cfg, _data, _hf_logprobs, model_logprobs

pytestmark = pytest.mark.timeout(300)

SGD = {"name": "torch.optim.SGD", "kwargs": {"lr": 1.0}}
LORA = {"enabled": True, "match_all_linear": True, "dim": 4, "alpha": 8, "use_triton": False}


def _lora_cfg(model_path):
    return _cfg(model_path, dtensor_cfg={"lora_cfg": LORA})


@pytest.fixture(scope="module")
def lora2(cluster, model_path, tokenizer):
    policy = Policy(cluster, _lora_cfg(model_path), tokenizer, num_workers=2, name_prefix="lora2")
    yield policy
    policy.shutdown()


def test_only_adapters_train_and_the_reference_is_the_base_model(lora2, model_path, tokenizer):
    data = _data(tokenizer)
    lp0 = lora2.get_logprobs(data)["logprobs"]
    # B starts at zero: the adapted model is the base model.
    torch.testing.assert_close(lp0, _hf_logprobs(model_path, data), atol=1e-5, rtol=1e-4)
    before = lora2.state_dict()
    losses = [float(lora2.train(data, NLLLoss())["loss"].mean()) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    after = lora2.state_dict()
    assert set(after) == set(before)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(is_adapter_parameter(k) for k in changed)
    assert {k for k in changed if ".lora_B." in k} == {k for k in before if ".lora_B." in k}
    ref = lora2.get_reference_policy_logprobs(data)["reference_logprobs"]
    torch.testing.assert_close(ref, lp0, atol=0, rtol=0)
    assert not torch.allclose(lora2.get_logprobs(data)["logprobs"], lp0, atol=1e-4)


def test_refit_sends_merged_weights_under_base_names(lora2, model_path, tokenizer):
    from phalanx.weights import ShmSegment, views

    data = _data(tokenizer, seed=2)
    lora2.train(data, NLLLoss())
    lp = lora2.get_logprobs(data)["logprobs"]
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    info = lora2.worker_group.call("prepare_refit_info").wait(timeout=60)[0]
    assert set(info) == set(plain.state_dict())
    g = lora2.worker_group
    # Each rank writes its own merged rows (the shared-memory path)...
    handle = next(iter(g.call("pack_weights_for_ipc").wait(timeout=120)[0].values()))
    seg = ShmSegment(handle["layout"].total_bytes, name=handle["name"], create=False)
    plain.load_state_dict({k: v.clone() for k, v in views(seg.tensor, handle["layout"]).items()})
    torch.testing.assert_close(model_logprobs(plain, data), lp, atol=1e-5, rtol=1e-4)
    # ...and NeMo-RL's gather-then-pack methods send the same weights.
    names = [k for k, _ in g.call("prepare_weights_for_ipc").wait(timeout=120)[0][0]]
    handle = next(iter(g.execute_on(0).get_weights_ipc_handles(names).wait(60)[0].values()))
    seg2 = ShmSegment(handle["layout"].total_bytes, name=handle["name"], create=False)
    gathered = views(seg2.tensor, handle["layout"])
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(gathered[k], v, atol=1e-6, rtol=0, msg=k)


def test_checkpoint_holds_peft_adapters_and_resumes(
    cluster, lora2, model_path, tokenizer, tmp_path
):
    from peft import PeftModel

    data = _data(tokenizer, seed=5)
    lora2.train(data, NLLLoss())
    w, o = str(tmp_path / "adapters"), str(tmp_path / "optim")
    lora2.save_checkpoint(w, o)
    assert os.path.isfile(os.path.join(w, "adapter_model.safetensors"))
    lp_saved = lora2.get_logprobs(data)["logprobs"]
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, w).get_base_model()
    torch.testing.assert_close(model_logprobs(loaded, data), lp_saved, atol=1e-5, rtol=1e-4)
    resumed = Policy(
        cluster,
        _lora_cfg(model_path),
        tokenizer,
        num_workers=2,
        name_prefix="lora_resumed",
        weights_path=w,
        optimizer_path=o,
    )
    try:
        torch.testing.assert_close(resumed.get_logprobs(data)["logprobs"], lp_saved, atol=0, rtol=0)
        next_a = lora2.train(data, NLLLoss())
        next_b = resumed.train(data, NLLLoss())
        torch.testing.assert_close(next_a["loss"], next_b["loss"], atol=0, rtol=0)
        torch.testing.assert_close(next_a["grad_norm"], next_b["grad_norm"], atol=0, rtol=0)
    finally:
        resumed.shutdown()


@pytest.mark.slow(reason="three two-rank LoRA policies (plain, dynamic batching, packing)")
def test_dynamic_batching_and_sequence_packing_with_adapters_equal_plain(
    cluster, model_path, tokenizer
):
    modes = {
        "plain": {},
        "dynamic": {
            "dynamic_batching": {
                "enabled": True,
                "train_mb_tokens": 40,
                "logprob_mb_tokens": 40,
                "sequence_length_round": 4,
            }
        },
        "packed": {
            "sequence_packing": {"enabled": True, "train_mb_tokens": 40, "logprob_mb_tokens": 40}
        },
    }
    data = _data(tokenizer, seed=7)
    results = {}
    for mode, over in modes.items():
        # SGD: Adam's first steps are nearly sign(gradient), which turns summation-order
        # noise of near-zero gradients into whole steps.
        cfg = _cfg(model_path, dtensor_cfg={"lora_cfg": LORA}, optimizer=SGD, **over)
        policy = Policy(cluster, cfg, tokenizer, num_workers=2, name_prefix=f"lora_{mode}")
        try:
            out = [policy.train(data, NLLLoss()) for _ in range(2)]
            results[mode] = (
                [o["loss"] for o in out],
                policy.get_logprobs(data)["logprobs"],
                policy.get_reference_policy_logprobs(data)["reference_logprobs"],
            )
        finally:
            policy.shutdown()
    plain = results.pop("plain")
    assert not torch.allclose(plain[1], plain[2], atol=1e-4)  # the adapters moved
    for mode, got in results.items():
        for a, b in zip(got[0], plain[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=mode)
        torch.testing.assert_close(got[1], plain[1], atol=1e-5, rtol=1e-4, msg=mode)
        torch.testing.assert_close(got[2], plain[2], atol=1e-5, rtol=1e-4, msg=mode)
