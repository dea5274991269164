"""The real-size GPU benchmarks' CPU-runnable parts: the architectures built from the
configs in ``benchmarks/gpu/configs``, the train, generation and kept-state benchmarks end
to end on the tiny model, GRPO's report, kernel kinds, ``run_kit.sh``'s argument check and
its test phase (in pytest-xdist processes). Not marked ``gpu``: CI runs these."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu import skips

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "benchmarks", "gpu")
sys.path.insert(0, KIT)

import _common  # noqa: E402
import bench_generate  # noqa: E402
import bench_grpo  # noqa: E402
import bench_keep_state  # noqa: E402
import bench_logprobs  # noqa: E402
import bench_refit  # noqa: E402
import bench_train  # noqa: E402

pytestmark = pytest.mark.timeout(240)

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}


@pytest.fixture
def dist_env(monkeypatch):
    """Restore the torch.distributed variables the benchmarks set for their rank 0."""
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "unset")


def test_an_architecture_is_built_from_its_published_config(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    assert _common.ARCHS == ["qwen2.5-0.5b", "qwen2.5-1.5b"]
    path = _common.build_arch_model("qwen2.5-1.5b", str(tmp_path / "m"), **SMALL)
    with open(os.path.join(KIT, "configs", "qwen2.5-1.5b.json")) as f:
        published = json.load(f)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "qwen2" and config.vocab_size == 151936
    assert config.num_attention_heads == 12 and config.num_key_value_heads == 2
    assert config.tie_word_embeddings is True
    assert config.max_position_embeddings == published["max_position_embeddings"]
    assert (config.hidden_size, config.num_hidden_layers) == (32, 1)  # the overrides
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert config.pad_token_id == tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(path)
    assert next(model.parameters()).dtype == torch.bfloat16  # saved in bf16
    with pytest.raises(ValueError, match=r"arch must be one of \['qwen2.5-0.5b'"):
        _common.build_arch_model("llama-70b", str(tmp_path / "x"))
    with pytest.raises(SystemExit, match="neither a folder with a config.json nor one of"):
        _common.model_path("qwen9", str(tmp_path))


def test_model_path_reuses_a_built_architecture(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_GPU_MODELS", str(tmp_path))
    built = _common.build_arch_model("qwen2.5-0.5b", str(tmp_path / "qwen2.5-0.5b"), **SMALL)
    stamp = os.path.getmtime(os.path.join(built, "model.safetensors"))
    assert _common.model_path("qwen2.5-0.5b", "/nonexistent") == built
    assert os.path.getmtime(os.path.join(built, "model.safetensors")) == stamp  # not rebuilt


def test_train_benchmark_runs_both_loops_on_the_same_tokens(tiny_model, dist_env, capsys):
    rec = bench_train.main(
        ["--model", tiny_model, "--rows", "8", "--seq", "32", "--mbs", "2", "--repeats", "1"]
        + ["--lengths", "varied", "--logprob-chunk-size", "7", "--logprob-kernel", "eager"]
        + ["--gather-once", "off"]
    )
    lengths = bench_train.batch_lengths(8, 32, "varied")
    assert rec["tokens"] == int(lengths.sum()) and rec["lengths"] == "varied"
    assert rec["logprob_chunk_size"] == 7 and rec["logprob_kernel"] == "eager"
    assert rec["gather_once"] is False  # the worker read the setting (auto: True here)
    assert rec["compile"] is False and rec["policy_first_step_s"] > 0
    on = bench_train.policy_config(tiny_model, 8, 32, 2, "cpu", compiled=True)["dtensor_cfg"]
    assert on["compile"] is True  # --compile on (test_compiled_layers.py runs it)
    assert set(rec["logprob_kernel_runs"]) == {"eager"}  # the worker's loss used the setting
    assert rec["policy_tokens_per_s"] > 0 and rec["plain_tokens_per_s"] > 0
    slowest = min(rec["policy_tokens_per_s"], rec["plain_tokens_per_s"])  # rounded to ints
    assert rec["ratio"] == pytest.approx(
        rec["policy_tokens_per_s"] / rec["plain_tokens_per_s"], rel=0.01 + 1 / slowest
    )
    assert rec["policy_mfu"] is None and rec["device"] == "cpu"  # no peak without a GPU
    assert "RATIO policy_train/plain_hf = " in capsys.readouterr().out
    assert lengths.min() >= 8 and lengths.max() <= 32
    assert bench_train.batch_lengths(4, 16, "uniform").tolist() == [16] * 4
    with pytest.raises(SystemExit):
        bench_train.main(["--model", tiny_model, "--rows", "6", "--mbs", "4"])


def test_logprob_benchmark_times_both_kernels_against_log_softmax(capsys):
    rec = bench_logprobs.main(["--rows", "2", "--seq", "16", "--vocab", "64", "--repeats", "1"])
    assert rec["shape"] == [2, 17, 64] and rec["dtype"] == "float32"
    assert set(rec["ms"]) == {"log_softmax", "eager", "compiled"}
    assert all(v > 0 for v in rec["ms"].values())
    ms, half = rec["ms"], 0.005  # ms are rounded to 0.01: the ratios lie within that
    for ratio, kernel in ((rec["ratio"], "compiled"), (rec["eager_ratio"], "eager")):
        assert (ms["log_softmax"] - half) / (ms[kernel] + half) <= ratio, kernel
        assert ratio <= (ms["log_softmax"] + half) / (ms[kernel] - half), kernel
    assert max(rec["max_abs_error"].values()) < 1e-4  # the same log-probs
    out = capsys.readouterr().out
    assert "RATIO logprobs_eager/log_softmax = " in out
    assert "RATIO logprobs_compiled/log_softmax = " in out


def test_the_plain_loop_trains_the_masked_tokens_only(tiny_model):
    batch = bench_train.make_batch(4, 16, 40, torch.tensor([16, 9, 12, 5]), pad=0)
    assert batch["token_mask"].sum() == 16 + 9 + 12 + 5
    assert (batch["input_ids"][1, 9:] == 0).all()
    step, model = bench_train.plain_hf_step(tiny_model, batch, 2, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_generate_benchmark_compares_the_same_batch(tiny_model, capsys):
    (rec,) = bench_generate.main(
        ["--model", tiny_model, "--prompts", "2", "--samples", "3", "--new", "5"]
        + ["--prompt-len", "4", "--repeats", "1"]
    )
    assert (rec["rows"], rec["new_tokens"], rec["prompt_len"]) == (6, 5, 4)
    assert rec["phalanx_tokens_per_s"] > 0 and rec["hf_tokens_per_s"] > 0
    assert "RATIO phalanx_generate/hf_generate = " in capsys.readouterr().out


def test_keep_state_benchmark_times_both_ways_and_leaves_nothing(tiny_model, dist_env, tmp_path):
    rec = bench_keep_state.main(["--model", tiny_model, "--repeats", "1", "--root", str(tmp_path)])
    assert rec["ratio_name"] == "keep_state/dcp_save" and rec["mib"] > 0
    assert min(rec["keep_s"], rec["first_keep_s"], rec["dcp_save_s"], rec["restore_s"]) > 0
    assert os.listdir(tmp_path) == []  # both ways' files removed


def test_refit_benchmark_times_the_first_refit_apart(tiny_model, dist_env, capsys):
    rec = bench_refit.main(["--model", tiny_model, "--repeats", "2"])
    assert rec["transport"] == "shm" and rec["device"] == "cpu" and rec["repeats"] == 2
    # the steady median over the floor (both rounded to 0.1 us in the record)
    assert rec["ratio"] == pytest.approx(rec["refit_s"] / rec["floor_s"], rel=0.05)
    for key in ("refit_s", "prepare_s", "handles_s", "update_s", "cold_refit_s"):
        assert rec[key] > 0, key
    out = capsys.readouterr().out
    assert "PARTS cold: prepare " in out and "PARTS steady: prepare " in out
    assert "RATIO refit_ipc/d2d_copy = " in out
    with pytest.raises(SystemExit):
        bench_refit.main(["--repeats", "0"])
    with pytest.raises(SystemExit, match="--narrow needs --model naming one of"):
        bench_refit.main(["--model", tiny_model, "--narrow"])


def test_a_narrow_architecture_has_every_tensor_of_the_published_one(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _common.narrow_model("qwen2.5-0.5b", str(tmp_path))
    narrow = AutoModelForCausalLM.from_pretrained(path)
    with open(os.path.join(KIT, "configs", "qwen2.5-0.5b.json")) as f:
        published = AutoConfig.for_model(**json.load(f))
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(published)
    assert list(narrow.state_dict()) == list(real.state_dict())  # 24 layers' tensors, by name
    assert narrow.config.tie_word_embeddings is True
    assert narrow.lm_head.weight is narrow.model.embed_tokens.weight
    assert {k: getattr(narrow.config, k) for k in _common.NARROW} == _common.NARROW
    assert sum(p.numel() for p in narrow.parameters()) * 2 < 2 << 20  # about 2 MiB in bf16


def test_grpo_report_takes_medians_after_the_first_step():
    history = [
        {"time/step": 9.0, "time/generation": 5, "time/logprobs": 1, "time/training": 2,
         "time/refit": 0.5, "response_length": 10},
        {"time/step": 4.0, "time/generation": 2, "time/logprobs": 0.5, "time/training": 1,
         "time/keep_state": 0.2, "time/refit": 0.1, "time/refit_wait": 0.05,
         "response_length": 20},
        {"time/step": 5.0, "time/generation": 3, "time/logprobs": 0.5, "time/training": 1,
         "time/keep_state": 0.4, "time/refit": 0.1, "time/refit_wait": 0.05,
         "response_length": 30},
    ]  # fmt: skip
    ratio, fig = bench_grpo.summarize(history, rows=4)
    assert fig["step_s"] == 4.5 and fig["generation_s"] == 2.5 and fig["first_step_s"] == 9.0
    assert fig["keep_state_s"] == pytest.approx(0.3) and "refit_wait_s" not in fig
    assert fig["generated_tokens_per_s"] == round(25 * 4 / 2.5)
    assert ratio == pytest.approx(4.5 / (2.5 + 0.5 + 1 + 0.3 + 0.1))
    with pytest.raises(SystemExit):
        bench_grpo.main(["--steps", "1"])


def test_kernel_kinds_and_the_cpu_profile(capsys):
    assert _common.kernel_kind("nvjet_sm90_tst_256x128_64x4") == "matmul"
    assert _common.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert _common.kernel_kind("Memcpy DtoD (Device -> Device)") == "copy/cast"
    assert _common.kernel_kind("ncclDevKernel_AllGather_RING") == "nccl"
    assert _common.kernel_kind("multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert _common.kernel_kind("vectorized_elementwise_kernel<CUDAFunctor_add>") == (
        "elementwise/other"
    )
    a = torch.randn(64, 64)
    text = _common.profile_summary(lambda: a @ a, "mm", rows=3)
    assert text.startswith("PROFILE mm: wall ") and "aten::mm" in text
    assert text in capsys.readouterr().out


def test_run_kit_names_an_unknown_benchmark():
    proc = subprocess.run(
        ["bash", os.path.join(KIT, "run_kit.sh"), "train_70b"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": "/tmp/px_kit_out_test"},
    )
    assert proc.returncode == 2
    assert "unknown argument 'train_70b'" in proc.stderr and "grpo_0.5b" in proc.stderr


def test_run_kit_runs_the_gpu_tests_in_parallel_and_records_them(tmp_path):
    """``run_kit.sh tests`` as on the GPU machine, in two pytest-xdist processes: every GPU
    test is collected and reported (here each skips, no CUDA) and timings.json counts them."""
    proc = subprocess.run(
        ["bash", os.path.join(KIT, "run_kit.sh"), "tests"],
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "OUT": str(tmp_path), "PHALANX_KIT_WORKERS": "2"},
    )
    log = (tmp_path / "pytest.log").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bringing up nodes" in log, log  # pytest-xdist's start
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["tests"]["tests"] == timings["tests"]["skipped"] == skips.KIT_TESTS
    assert timings["tests"]["failures"] == timings["tests"]["errors"] == 0
