"""``--resume`` of a run with another environment (or network) than its checkpoint's: an
error naming the file and the field, before anything starts."""

from __future__ import annotations

import pytest

from phalanx.algorithms import ppo
from phalanx.algorithms.ppo_config import PPOConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cartpole_run(tmp_path):
    cfg = PPOConfig(env="CartPole-v1", num_env_runners=0, num_envs_per_env_runner=1,
                    rollout_fragment_length=64, minibatch_size=32, max_timesteps=64,
                    runs_dir=str(tmp_path), name="r")  # fmt: skip
    ppo.train(cfg, progress=False)
    return tmp_path / "r"


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--env", "Acrobot-v1"], "env: the checkpoint {ckpt} was trained with "
         "env='CartPole-v1', not 'Acrobot-v1'"),
        (["--hidden", "32"], "hidden: the checkpoint {ckpt} was trained with hidden=(64, 64), "
         "not (32,)"),
    ],
)  # fmt: skip
def test_resume_with_another_env_or_network_names_the_file(cartpole_run, capsys, flags, why):
    ckpt = cartpole_run / "checkpoints" / "step_1"
    before = (ckpt / "learner.pt").read_bytes()
    argv = ["--resume", "--name", "r", "--runs-dir", str(cartpole_run.parent), "--no-progress"]
    capsys.readouterr()
    assert ppo.cli(argv + flags) == 1
    err = capsys.readouterr().err.splitlines()
    flag = flags[0]
    assert err == [
        f"phalanx train ppo: error: {why.format(ckpt=ckpt)}; --resume continues a run with "
        f"its own environment and network (start a new run under another --name) "
        f"(flag {flag})"
    ]
    assert (ckpt / "learner.pt").read_bytes() == before
