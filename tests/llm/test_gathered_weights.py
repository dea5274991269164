"""FSDP2's gathered weights kept for a whole optimizer step (``gather_weights_once_per_step``):
a one-rank CPU policy in this process, trained with it and without it on the same batch.

Kept, the weights a loss sees are the gathered (plain) tensors on every micro-batch and the
step's results are bit-for-bit those of gathering per forward and backward; after the step,
after an evaluation and after a step that failed midway, the model holds its sharded
DTensor parameters again (``state_dict`` and in-place swaps rely on it).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import phalanx as px
from phalanx.llm.fsdp_state import gathers_once
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy_config import ConfigError, check_policy_config
from phalanx.llm.policy_worker import DTensorPolicyWorker
from tests.gpu.procs import policy_config, rank0_env_vars

pytestmark = pytest.mark.timeout(240)


def _batch() -> px.BatchedDataDict:
    """8 rows of 16 tokens: 4 micro-batches of 2 (``policy_config``'s sizes)."""
    ids = torch.randint(3, 40, (8, 16), generator=torch.Generator().manual_seed(0))
    return px.BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.full((8,), 16),
            "token_mask": torch.ones(8, 16),
            "sample_mask": torch.ones(8),
        }
    )


class _Watch(NLLLoss):
    """NLL that records, at each micro-batch, how many of the model's parameters are
    sharded DTensors (0: the forward ran on kept gathered weights), and can fail."""

    def __init__(self, model: torch.nn.Module, fail_at: int | None = None) -> None:
        self.model, self.fail_at, self.sharded = model, fail_at, []

    def __call__(self, *args, **kwargs):
        self.sharded.append(sum(isinstance(p, DTensor) for p in self.model.parameters()))
        if len(self.sharded) == self.fail_at:
            raise RuntimeError("loss failed on purpose")
        return super().__call__(*args, **kwargs)


def _all_sharded(worker: DTensorPolicyWorker) -> bool:
    return all(isinstance(p, DTensor) for p in worker.model.parameters())


def _worker(model_path, tokenizer, monkeypatch, gather) -> DTensorPolicyWorker:
    """A one-rank policy in bf16 mixed precision (a gather casts, as on a GPU)."""
    for k, v in rank0_env_vars().items():  # a fresh port: each worker is a new group
        monkeypatch.setenv(k, v)
    dcfg = {} if gather is None else {"gather_weights_once_per_step": gather}
    cfg = policy_config(model_path, dtensor_cfg=dcfg, precision="bfloat16")
    return DTensorPolicyWorker(cfg, tokenizer, init_reference_model=False)


def _two_steps(worker: DTensorPolicyWorker) -> tuple[list, list, dict]:
    """Two optimizer steps on ``_batch()``: the loss's observations, the results, weights."""
    watch = _Watch(worker.model)
    results = [worker.train(_batch(), watch) for _ in range(2)]
    losses = [(r["global_loss"], r["grad_norm"]) for r in results]
    return watch.sharded, losses, {k: v.clone() for k, v in worker.return_full_state_dict().items()}


def test_kept_weights_give_the_same_steps_and_are_released_after_each(
    model_path, tokenizer, monkeypatch
):
    runs = {}
    for gather in (False, None):  # None: "auto", which keeps them with one FSDP shard
        worker = _worker(model_path, tokenizer, monkeypatch, gather)
        try:
            assert worker.gather_once is (gather is None)
            runs[gather] = _two_steps(worker)
            assert _all_sharded(worker)
            # an evaluation never keeps them (no backward would release them)
            watch = _Watch(worker.model)
            worker.train(_batch(), watch, eval_mode=True)
            n = len(list(worker.model.parameters()))
            assert watch.sharded == [n] * 4 and _all_sharded(worker)
        finally:
            worker.shutdown()
    n = len(list(runs[False][2]))
    assert runs[False][0] == [n] * 8  # resharded after every forward
    assert runs[None][0] == [0] * 8  # every micro-batch of both steps ran on kept weights
    for (loss_a, norm_a), (loss_b, norm_b) in zip(runs[False][1], runs[None][1], strict=True):
        assert torch.equal(loss_a, loss_b) and torch.equal(norm_a, norm_b)
    assert runs[False][2].keys() == runs[None][2].keys()
    for k, v in runs[False][2].items():
        assert torch.equal(v, runs[None][2][k]), k


def test_a_step_that_fails_midway_leaves_the_weights_sharded(model_path, tokenizer, monkeypatch):
    worker = _worker(model_path, tokenizer, monkeypatch, True)
    try:
        watch = _Watch(worker.model, fail_at=3)
        with pytest.raises(RuntimeError, match="loss failed on purpose"):
            worker.train(_batch(), watch)
        assert watch.sharded == [0, 0, 0]
        assert _all_sharded(worker)
        # the next step gathers again and trains
        after = _Watch(worker.model)
        out = worker.train(_batch(), after)
        assert after.sharded == [0] * 4 and torch.isfinite(out["global_loss"]).all()
        assert _all_sharded(worker)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_the_setting_takes_auto_or_a_bool(model_path, value):
    cfg = policy_config(model_path, dtensor_cfg={"gather_weights_once_per_step": value})
    with pytest.raises(ConfigError, match="dtensor_cfg.gather_weights_once_per_step"):
        check_policy_config(cfg)
    for ok in ("auto", None, True, False):  # None: "auto"
        cfg["dtensor_cfg"]["gather_weights_once_per_step"] = ok
        check_policy_config(cfg)


def test_auto_keeps_them_with_one_fsdp_shard_and_no_cpu_offload():
    """With more shards the kept copy would be the whole model's on every rank; with CPU
    offload, on the accelerator the offload frees. Checked on the rule the worker applies."""
    assert gathers_once("auto", fsdp_shards=1, cpu_offload=False) is True
    assert gathers_once("auto", fsdp_shards=2, cpu_offload=False) is False
    assert gathers_once("auto", fsdp_shards=1, cpu_offload=True) is False
    assert gathers_once(True, fsdp_shards=4, cpu_offload=True) is True
    assert gathers_once(False, fsdp_shards=1, cpu_offload=False) is False
