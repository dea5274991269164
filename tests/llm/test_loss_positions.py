"""Losses that read masked positions only give the same loss, metrics and gradients when
the prompt's logits are never computed (the policy worker's ``logits_to_keep`` path), in
one process with a tiny random Llama (no Ray)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from phalanx.algorithms.grpo_loss import OnPolicyPGLossFn
from phalanx.llm.loss import (
    ClippedPGLossFn,
    NLLLoss,
    drop_leading_positions,
    first_loss_position,
)

pytestmark = pytest.mark.timeout(120)


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(cfg).float()


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (3, 12), generator=g)
    mask = torch.zeros(3, 12)
    mask[0, 5:10] = 1  # prompts of 5, 7 and 6 tokens, then responses, then padding
    mask[1, 7:12] = 1
    mask[2, 6:9] = 1
    return {
        "input_ids": ids,
        "token_mask": mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0]),
        "advantages": torch.tensor([0.5, -1.0, 2.0]),
        "prev_logprobs": -torch.rand(3, 12, generator=g),
        "reference_policy_logprobs": -torch.rand(3, 12, generator=g),
    }


def _run(model, loss_fn, data, trim: bool):
    model.zero_grad(set_to_none=True)
    T = data["input_ids"].shape[1]
    start = first_loss_position(data) if trim else 0
    kwargs = {"logits_to_keep": T - start} if start else {}
    logits = model(input_ids=data["input_ids"], use_cache=False, **kwargs).logits
    assert logits.shape[1] == T - start
    loss, metrics = loss_fn(
        logits, drop_leading_positions(data, start), torch.tensor(2.0), torch.tensor(8.0)
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.smoke
def test_first_loss_position_is_the_earliest_valid_prediction_of_a_kept_row() -> None:
    data = _batch()
    # row 2 is masked out, so row 0's first response token (position 5) sets it: logits
    # of position 4 predict it
    assert first_loss_position(data) == 4
    assert first_loss_position({**data, "sample_mask": torch.ones(3)}) == 4
    assert first_loss_position({"input_ids": data["input_ids"]}) == 0
    assert first_loss_position({**data, "token_mask": torch.zeros(3, 12)}) == 0
    cut = drop_leading_positions(data, 4)
    assert cut["input_ids"].shape == (3, 8) and cut["token_mask"].shape == (3, 8)
    assert torch.equal(cut["advantages"], data["advantages"])  # per row: not cut
    assert drop_leading_positions(data, 0) is data


@pytest.mark.parametrize(
    "loss_fn",
    [
        NLLLoss(),
        ClippedPGLossFn({"reference_policy_kl_penalty": 0.1}),
        OnPolicyPGLossFn({"reference_policy_kl_penalty": 0.0}),
    ],
    ids=["nll", "clipped_pg_kl", "on_policy_pg"],
)
def test_masked_losses_are_unchanged_without_the_prompts_logits(loss_fn) -> None:
    assert loss_fn.masked_positions_only
    model, data = _model(), _batch()
    if isinstance(loss_fn, OnPolicyPGLossFn):
        data = {k: v for k, v in data.items() if k != "prev_logprobs"}
    loss_a, met_a, grads_a = _run(model, loss_fn, data, trim=False)
    loss_b, met_b, grads_b = _run(model, loss_fn, data, trim=True)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-5)
    assert met_b.keys() == met_a.keys()
    for k in met_a:
        assert met_b[k] == pytest.approx(met_a[k], rel=1e-5, abs=1e-6), k
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 21
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-4)


def test_on_policy_loss_ratio_is_one_and_equals_the_clipped_loss_with_detached_logprobs():
    model, data = _model(), _batch()
    del data["prev_logprobs"]
    logits = model(input_ids=data["input_ids"], use_cache=False).logits
    loss, metrics = OnPolicyPGLossFn({"reference_policy_kl_penalty": 0.0})(
        logits, data, torch.tensor(2.0), torch.tensor(8.0)
    )
    assert metrics["ratio_sum"] == pytest.approx(metrics["num_valid_tokens"])
    assert metrics["clip_frac_sum"] == 0.0
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])
    prev = torch.nn.functional.pad(lp.squeeze(-1).detach(), (1, 0))
    ref, _ = ClippedPGLossFn({"reference_policy_kl_penalty": 0.0})(
        logits, {**data, "prev_logprobs": prev}, torch.tensor(2.0), torch.tensor(8.0)
    )
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-5)
