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
        (["--model", "tiny", "--lora-rank", "8"], "lora_rank > 0 with warmup_steps > 0"),
    ],
)
def test_bad_lora_flags_exit_bad_input(argv, message, capsys):
    assert cli(argv) == harness.BAD_INPUT
    assert message in capsys.readouterr().err
