"""``phalanx train grpo --lora-rank R [--lora-alpha A] [--lora-target-modules ...]``: the
flags map onto NeMo-RL's ``policy.dtensor_cfg.lora_cfg``; bad values exit BAD_INPUT
before anything starts."""

from __future__ import annotations

import pytest

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.grpo import TrainGRPO, cli
from phalanx.algorithms.grpo_config import GRPOConfig
from phalanx.llm.lora import LoraSettings, lora_settings


def test_lora_flags_map_onto_nemo_rl_lora_cfg():
    argv = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-target-modules", "q_proj", "v_proj"]
    cfg = harness.parse_flags(TrainGRPO, argv, TrainGRPO(GRPOConfig()), "p", "").grpo
    cfg.validate()
    assert cfg.lora_cfg() == {
        "enabled": True,
        "dim": 8,
        "alpha": 16.0,
        "target_modules": ["q_proj", "v_proj"],
        "match_all_linear": False,
        "use_triton": False,
    }
    every_linear = lora_settings(GRPOConfig(lora_rank=32).lora_cfg())
    assert every_linear == LoraSettings(match_all_linear=True, dim=32)
    assert lora_settings(GRPOConfig().lora_cfg()) is None  # full fine-tuning


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-rank", "-1"], "lora_rank must be >= 0, got -1"),
        (["--lora-rank", "8", "--lora-alpha", "0"], "lora_cfg (--lora-rank/--lora-alpha/"),
    ],
)
def test_bad_lora_flags_exit_bad_input(argv, message, capsys):
    assert cli(argv) == harness.BAD_INPUT
    assert message in capsys.readouterr().err


@pytest.mark.slow(reason="two GRPO runs (a LoRA run, then its resume), each starting its workers")
@pytest.mark.timeout(300)
def test_lora_run_through_the_cli_checkpoints_adapters_and_resumes(cluster, tmp_path):
    """``phalanx train grpo --lora-rank 4``: two steps, a checkpoint holding peft's adapter
    files (``PeftModel.from_pretrained`` loads them onto the base model), then ``--resume``
    continues the LoRA run from them for one more step."""
    import json
    import os

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = str(tmp_path / "run")
    argv = [
        "--model", "tiny",
        "--run-dir", run_dir,
        "--steps", "2",
        "--prompts-per-step", "2",
        "--samples-per-prompt", "2",
        "--train-micro-batch-size", "2",
        "--num-policy-workers", "1",  # two ranks' adapters: tests/llm/test_lora_policy.py
        "--warmup-steps", "0",
        "--eval-every", "0",
        "--checkpoint-every", "2",
        "--lora-rank", "4",
        "--lora-alpha", "8",
        "--no-progress",
    ]  # fmt: skip
    assert cli(argv) == 0
    weights = os.path.join(run_dir, "checkpoints", "step_2", "weights")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(weights))
    with open(os.path.join(weights, "adapter_config.json")) as f:
        saved = json.load(f)
    assert (saved["r"], saved["lora_alpha"]) == (4, 8.0)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "base_model"))
    loaded = PeftModel.from_pretrained(base, weights)
    a = {n: p for n, p in loaded.named_parameters() if "lora_A" in n}
    assert a and all(p.shape[0] == 4 for p in a.values())  # rank-4 factors on every layer

    assert cli(["--resume", "--run-dir", run_dir, "--steps", "3", "--no-progress"]) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["lora_rank"] == 4  # the resumed run kept its adapters


@pytest.mark.slow(reason="a GRPO run: its workers start, three warm-up steps, then a LoRA step")
@pytest.mark.timeout(300)
def test_tiny_lora_warms_up_the_whole_model_then_trains_adapters_on_it(cluster, tmp_path):
    """``--model tiny --lora-rank 4``: the tiny preset's warm-up trains the whole model, its
    result (``sft_model``) becomes the frozen base and reference, and the adapters train on
    it; the checkpoint's adapters load onto that base."""
    import os

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from phalanx.algorithms.grpo import train

    run_dir = str(tmp_path / "run")
    cfg = GRPOConfig.tiny(
        run_dir=run_dir, steps=1, warmup_steps=3, warmup_batch_size=8, prompts_per_step=2,
        samples_per_prompt=2, train_micro_batch_size=2, num_policy_workers=1, eval_every=0,
        lora_rank=4, lora_alpha=8.0, progress=False,
    )  # fmt: skip
    result = train(cfg, cluster)
    assert [row["step"] for row in result["history"]] == [1]
    base = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "base_model"))
    warmed = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "sft_model"))
    changed = [n for n, p in warmed.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert changed  # the warm-up trained the whole model
    weights = os.path.join(run_dir, "checkpoints", "step_1", "weights")
    loaded = PeftModel.from_pretrained(warmed, weights)
    assert any("lora_A" in n for n, _ in loaded.named_parameters())
