"""The DTensor policy worker on CUDA, world size 1 (NCCL), built in the test process.

Each test builds its own ``DTensorPolicyWorker`` (rank 0 of 1, the rendezvous from
``rank0_env``) and shuts it down, which destroys its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import pytest
import torch

from tests.gpu import procs
from tests.gpu.skips import needs_gpu

pytestmark = [*needs_gpu(), pytest.mark.timeout(300)]

NEMO_INFO_KEYS = {
    "rank",
    "world_size",
    "local_rank",
    "local_device_id",
    "global_device_id",
    "device_count",
    "device_name",
    "memory_allocated_mb",
    "memory_reserved_mb",
    "peak_memory_allocated_mb",
    "peak_memory_reserved_mb",
    "parameter_sample",
    "env_vars",
}


@contextlib.contextmanager
def cuda_worker(model_path, tokenizer, **over):
    import phalanx as px

    worker = px.DTensorPolicyWorker(procs.policy_config(model_path, **over), tokenizer)
    try:
        yield worker
    finally:
        worker.shutdown()


def _data(tokenizer, n=8, seed=0):
    from phalanx.algorithms.grpo_tiny_task import AdditionTask, sft_batch

    return sft_batch(tokenizer, AdditionTask(seed).sample_prompts(n))


def _cpu_worker_logprobs(model_path, data):
    """The CPU worker's log-probs, computed in a process that sees no GPU."""
    (q,) = procs.queues(1)
    proc = procs.start(
        procs.cpu_logprobs, q, model_path, data, procs.free_port(), env={"CUDA_VISIBLE_DEVICES": ""}
    )
    try:
        return procs.get_by_value(q, 240)["logprobs"]
    finally:
        proc.join(60)


def _optimizer_devices(worker):
    return {
        v.device.type
        for state in worker.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }


def _param_device(worker) -> str:
    return next(iter(worker.get_gpu_info()["parameter_sample"].values()))["device"]


@pytest.mark.parametrize(("precision", "atol"), [("float32", 1e-4), ("bfloat16", 0.15)])
def test_logprobs_equal_the_cpu_workers(rank0_env, tiny_model, tiny_tokenizer, precision, atol):
    data = _data(tiny_tokenizer)
    expected = _cpu_worker_logprobs(tiny_model, data)
    with cuda_worker(tiny_model, tiny_tokenizer, precision=precision) as worker:
        assert worker.device.type == "cuda" and _param_device(worker).startswith("cuda")
        lp = worker.get_logprobs(data)["logprobs"]
        ref = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert lp.shape == data["input_ids"].shape and lp.device.type == "cpu"
    assert torch.all(lp[:, 0] == 0) and float(expected.abs().sum()) > 0
    torch.testing.assert_close(lp, expected, atol=atol, rtol=0)
    torch.testing.assert_close(ref, lp, atol=0, rtol=0)


def test_train_keeps_the_reference_and_offload_round_trips(rank0_env, tiny_model, tiny_tokenizer):
    from phalanx.llm.loss import NLLLoss

    data = _data(tiny_tokenizer, n=16)
    with cuda_worker(tiny_model, tiny_tokenizer) as worker:
        lp0 = worker.get_logprobs(data)["logprobs"]
        ref0 = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
        losses = [float(worker.train(data, NLLLoss())["global_loss"].sum()) for _ in range(6)]
        assert losses[-1] < losses[0] * 0.8, losses
        ref1 = worker.get_reference_policy_logprobs(data)["reference_logprobs"]
        torch.testing.assert_close(ref1, ref0, atol=1e-6, rtol=0)
        lp1 = worker.get_logprobs(data)["logprobs"]
        assert not torch.allclose(lp1, lp0, atol=1e-3)
        assert _optimizer_devices(worker) == {"cuda"}

        worker.offload_before_refit()
        assert _optimizer_devices(worker) == {"cpu"}
        info, free = worker.prepare_weights_for_ipc()
        assert (
            "model.embed_tokens.weight" in dict(info) and 0 < free <= torch.cuda.mem_get_info()[1]
        )
        on_gpu = torch.cuda.memory_allocated()
        worker.offload_after_refit()
        assert _param_device(worker) == "cpu" and torch.cuda.memory_allocated() < on_gpu
        worker.prepare_for_training()
        assert _param_device(worker).startswith("cuda") and _optimizer_devices(worker) == {"cuda"}
        torch.testing.assert_close(worker.get_logprobs(data)["logprobs"], lp1, atol=0, rtol=0)

        worker.model = worker.move_to_cpu(worker.model)
        assert _param_device(worker) == "cpu"
        worker.model = worker.move_to_cuda(worker.model)
        assert _param_device(worker).startswith("cuda")
        torch.testing.assert_close(worker.get_logprobs(data)["logprobs"], lp1, atol=0, rtol=0)
        # a step after the round trips still trains
        assert float(worker.train(data, NLLLoss())["global_loss"].sum()) < losses[-1]


def test_gpu_info_device_id_and_profiling(rank0_env, tiny_model, tiny_tokenizer, tmp_path):
    data = _data(tiny_tokenizer)
    with cuda_worker(tiny_model, tiny_tokenizer, profile_dir=str(tmp_path)) as worker:
        worker.reset_peak_memory_stats()
        worker.get_logprobs(data)
        info = worker.get_gpu_info()
        uuid = worker.report_device_id()
        worker.start_gpu_profiling()
        with pytest.raises(RuntimeError, match="already running"):
            worker.start_gpu_profiling()
        worker.get_logprobs(data)
        path = worker.stop_gpu_profiling()
    assert set(info) >= NEMO_INFO_KEYS
    assert info["cuda"] is True and info["device"] == "cuda:0"
    assert info["rank"] == 0 and info["world_size"] == 1 and info["local_device_id"] == 0
    assert info["device_count"] == torch.cuda.device_count() >= 1
    assert info["device_name"] == torch.cuda.get_device_name(0)
    assert info["total_memory"] == torch.cuda.get_device_properties(0).total_memory
    assert 0 < info["memory_allocated_mb"] <= info["memory_reserved_mb"]
    assert info["memory_allocated_mb"] <= info["peak_memory_allocated_mb"]
    assert info["peak_memory_allocated_mb"] <= info["peak_memory_reserved_mb"]
    assert info["peak_memory_reserved_mb"] * 2**20 < info["total_memory"]
    assert uuid == info["device_uuid"] == str(torch.cuda.get_device_properties(0).uuid)
    assert re.fullmatch(
        r"(GPU-)?[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uuid
    )
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), "no CUDA kernel in the trace"


def test_move_to_cuda_after_cpu_offload_config(rank0_env, tiny_model, tiny_tokenizer):
    """``dtensor_cfg.cpu_offload``: FSDP2 keeps parameters on the host and computes on the
    GPU; log-probs equal those of the plain GPU worker."""
    data = _data(tiny_tokenizer)
    with cuda_worker(tiny_model, tiny_tokenizer) as worker:
        plain = worker.get_logprobs(data)["logprobs"]
    with cuda_worker(tiny_model, tiny_tokenizer, dtensor_cfg={"cpu_offload": True}) as worker:
        assert _param_device(worker) == "cpu"
        offloaded = worker.get_logprobs(data)["logprobs"]
    torch.testing.assert_close(offloaded, plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_compiled_layers_train_as_the_eager_ones(
    monkeypatch, tiny_model, tiny_tokenizer, precision
):
    """``dtensor_cfg.compile``: inductor's CUDA kernels give the eager steps and log-probs,
    and the compiled layers still run after an offload round trip."""
    from torch._dynamo.utils import counters

    from phalanx.llm.loss import NLLLoss

    data = _data(tiny_tokenizer, n=16)
    torch.compiler.reset()  # graphs of an earlier test would be reused, not counted
    graphs = counters["stats"]["unique_graphs"]
    sgd = {"name": "torch.optim.SGD", "kwargs": {"lr": 0.5}}
    runs = {}
    for compiled in (False, True):
        for k, v in procs.rank0_env_vars().items():  # a fresh port: each worker is a new group
            monkeypatch.setenv(k, v)
        over = {
            "dtensor_cfg": {"compile": compiled},
            "logprob_kernel": "eager",  # "auto" would compile it on CUDA: only the layers do
            "optimizer": sgd,
            "precision": precision,
        }
        with cuda_worker(tiny_model, tiny_tokenizer, **over) as worker:
            losses = [float(worker.train(data, NLLLoss())["global_loss"].sum()) for _ in range(2)]
            worker.offload_before_refit()
            worker.offload_after_refit()
            worker.prepare_for_training()
            runs[compiled] = (losses, worker.get_logprobs(data)["logprobs"])
        assert (counters["stats"]["unique_graphs"] > graphs) is compiled
    (eager_losses, eager_lp), (losses, lp) = runs[False], runs[True]
    tol = {"float32": 1e-4, "bfloat16": 0.15}[precision]
    assert losses == pytest.approx(eager_losses, abs=tol / 10 if precision == "float32" else 0.05)
    torch.testing.assert_close(lp, eager_lp, atol=tol, rtol=0)
