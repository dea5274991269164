"""Compiled decoder layers (``dtensor_cfg.compile``): policies trained with them and without
them on the same batch (one rank in this process; two ranks through ``Policy``).

The compiled layers give the same losses, gradient norms, log-probs and reference log-probs
as the eager ones (float32: only the fused kernels' summation order differs), with plain
micro-batches, with packed sequences and activation checkpointing (a new shape per
micro-batch, and layers run again in the backward) with LoRA adapters in the layers; and
through ``Policy`` over two ranks, where FSDP2 gathers each layer's weights before its
compiled code runs.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import phalanx as px
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy_config import ConfigError, check_policy_config
from phalanx.llm.policy_worker import DTensorPolicyWorker
from tests.gpu.procs import policy_config, rank0_env_vars

pytestmark = pytest.mark.timeout(300)

SGD = {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}}
LORA = {"enabled": True, "match_all_linear": True, "dim": 4, "alpha": 8, "use_triton": False}
CASES = {
    "plain": {},
    "packed_checkpointed_lora": {
        "dtensor_cfg": {"activation_checkpointing": True, "lora_cfg": LORA},
        "sequence_packing": {"enabled": True, "train_mb_tokens": 40, "logprob_mb_tokens": 40},
    },
}
# Inductor compiles a case's graphs in 50-75 s on 2 cores without its on-disk cache
# (one per machine, under the temporary folder), in 2-16 s with it.
COLD_COMPILE = "compiles the layers with inductor: about a minute on 2 cores on a fresh machine"

PACKING = {
    "input_key": "input_ids",
    "input_lengths_key": "input_lengths",
    "algorithm": "modified_first_fit_decreasing",
}


def _batch(packing: dict | None) -> px.BatchedDataDict:
    """8 rows of 5-16 tokens; with ``packing`` (the config's), packed as ``Policy`` does."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40, (8, 16), generator=g)
    lengths = torch.randint(5, 17, (8,), generator=g)
    mask = (torch.arange(16)[None] < lengths[:, None]).float()
    data = px.BatchedDataDict(
        {
            "input_ids": ids * mask.long(),
            "input_lengths": lengths,
            "token_mask": mask,
            "sample_mask": torch.ones(8),
        }
    )
    if packing is None:
        return data
    args = {**PACKING, "max_tokens_per_microbatch": packing["train_mb_tokens"]}
    (shard,), _ = data.shard_by_batch_size(1, batch_size=8, sequence_packing_args=args)
    return shard


def _run(model_path, tokenizer, monkeypatch, over: dict, compiled: bool) -> tuple[list, int]:
    """Two steps, then log-probs and reference log-probs; and the graphs Dynamo compiled."""
    for k, v in rank0_env_vars().items():  # a fresh port: each worker is a new group
        monkeypatch.setenv(k, v)
    dcfg = {**over.get("dtensor_cfg", {}), "compile": compiled}
    cfg = policy_config(model_path, **{**over, "dtensor_cfg": dcfg, "optimizer": SGD})
    packing = over.get("sequence_packing")
    torch.compiler.reset()  # graphs compiled by an earlier test would be reused, not counted
    before = counters["stats"]["unique_graphs"]
    worker = DTensorPolicyWorker(cfg, tokenizer, init_reference_model=True)
    try:
        steps = [worker.train(_batch(packing), NLLLoss()) for _ in range(2)]
        out = [(s["global_loss"], s["grad_norm"]) for s in steps]
        out.append(worker.get_logprobs(_batch(packing))["logprobs"])
        out.append(worker.get_reference_policy_logprobs(_batch(packing))["reference_logprobs"])
    finally:
        worker.shutdown()
    return out, counters["stats"]["unique_graphs"] - before


@pytest.mark.slow(reason=COLD_COMPILE)
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_layers_give_the_eager_results(case, model_path, tokenizer, monkeypatch):
    eager, eager_graphs = _run(model_path, tokenizer, monkeypatch, CASES[case], False)
    compiled, graphs = _run(model_path, tokenizer, monkeypatch, CASES[case], True)
    assert eager_graphs == 0
    assert graphs >= 1
    (l1, n1), (l2, n2) = eager[:2]
    assert float(l2) != pytest.approx(float(l1), abs=1e-4)  # the first step moved the weights
    for got, want in zip(compiled[:2], eager[:2]):
        torch.testing.assert_close(
            torch.as_tensor(got), torch.as_tensor(want), rtol=1e-5, atol=1e-6
        )
    torch.testing.assert_close(compiled[2], eager[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[3], eager[3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dcfg, match",
    [
        ({"compile": "yes"}, "dtensor_cfg.compile must be True or False"),
        ({"compile": True, "tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
        ({"compile": True, "context_parallel_size": 2}, "context_parallel_size > 1"),
    ],
)
def test_compile_config_is_checked(model_path, dcfg, match) -> None:
    with pytest.raises(ConfigError, match=match):
        check_policy_config(policy_config(model_path, dtensor_cfg=dcfg))
    check_policy_config(policy_config(model_path, dtensor_cfg={"compile": False}))


def _graphs(worker) -> int:
    """The graphs Dynamo compiled in the worker's process."""
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow(reason=f"two two-rank policies start; {COLD_COMPILE}")
def test_two_ranks_with_compiled_layers_train_as_eager_ones(cluster, model_path, tokenizer):
    """FSDP2 over two ranks (gloo): each rank's compiled layers run on the gathered weights."""
    from phalanx.llm.policy import Policy
    from tests.llm.test_llm_policy import _cfg, _data

    data = _data(tokenizer, seed=3)
    results = {}
    for compiled in (False, True):
        cfg = _cfg(model_path, dtensor_cfg={"compile": compiled}, optimizer=SGD)
        name = f"compiled_{compiled}".lower()
        policy = Policy(cluster, cfg, tokenizer, num_workers=2, name_prefix=name)
        try:
            losses = [policy.train(data, NLLLoss())["loss"] for _ in range(2)]
            results[compiled] = (losses, policy.get_logprobs(data)["logprobs"])
            calls = [(rank, (), {}) for rank in range(2)]
            graphs = policy.worker_group.apply(_graphs, calls).wait(timeout=60)
            assert [n > 0 for n in graphs] == [compiled, compiled]
        finally:
            policy.shutdown()
    (eager_losses, eager_lp), (losses, lp) = results[False], results[True]
    assert not torch.allclose(eager_losses[1], eager_losses[0], atol=1e-4)  # weights moved
    for got, want in zip(losses, eager_losses):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp, eager_lp, rtol=1e-5, atol=1e-5)
