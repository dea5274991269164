"""``--resume`` after a kill: the steps after the checkpoint are redone, and their metrics
rows are written once (the rows the killed run wrote past its checkpoint are dropped)."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from phalanx.algorithms import ppo
from phalanx.algorithms.ppo_config import PPOConfig
from phalanx.observe.metrics import MetricsLogger, read_metrics

pytestmark = pytest.mark.timeout(120)


def test_rows_past_the_checkpoint_are_written_once_after_resume(tmp_path):
    cfg = PPOConfig(env="CartPole-v1", num_env_runners=0, num_envs_per_env_runner=1,
                    rollout_fragment_length=64, minibatch_size=32, max_timesteps=128,
                    runs_dir=str(tmp_path),
                    name="r", checkpoint_every=1)  # fmt: skip
    run = tmp_path / "r"
    ppo.train(cfg, progress=False)
    shutil.copytree(run / "checkpoints" / "step_2", tmp_path / "at_128")
    ppo.train(replace(cfg, max_timesteps=256), resume=True, progress=False)
    assert [r["step"] for r in read_metrics(run)] == [64, 128, 192, 256]
    # A kill -9 after step 256 whose last checkpoint was at 128: rows 192 and 256 exist,
    # the checkpoint does not have them.
    shutil.rmtree(run / "checkpoints")
    shutil.copytree(tmp_path / "at_128", run / "checkpoints" / "step_2")
    ppo.train(replace(cfg, max_timesteps=256), resume=True, progress=False)
    assert [r["step"] for r in read_metrics(run)] == [64, 128, 192, 256]


def test_drop_after_keeps_earlier_rows_and_drops_a_torn_line(tmp_path):
    with MetricsLogger(tmp_path, use_tensorboard=False) as log:
        for step in (1, 2, 3):
            log.log(step, {"x": step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x"')  # torn by a crash
    with MetricsLogger(tmp_path, use_tensorboard=False) as log:
        assert log.drop_after(2) == 2
        log.log(3, {"x": 30})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 2), (3, 30)]
