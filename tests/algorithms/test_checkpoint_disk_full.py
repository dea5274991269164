"""A full disk while PPO writes its checkpoint: an error naming the file and ENOSPC, the
previous checkpoint kept, nothing half-written left, exit 4 with ``status.json``.

The full disk is real: the checkpoint's temporary file (or ``status.json``) is a symlink
to ``/dev/full``, where every write fails with ENOSPC."""

from __future__ import annotations

import errno
import json
import os

import pytest

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.ppo import build_learner, load_checkpoint, save_checkpoint
from phalanx.algorithms.ppo_config import PPOConfig

pytestmark = pytest.mark.timeout(60)


def _save(path, cfg, learner, timesteps: int) -> None:
    save_checkpoint(path, learner.policy, learner.optimizer, {}, timesteps, 1, 1, cfg,
                    learner.spaces)  # fmt: skip


@pytest.fixture
def learner():
    cfg = PPOConfig(env="CartPole-v1")
    return cfg, build_learner(cfg, None)


def test_full_disk_names_the_file_and_keeps_the_previous_checkpoint(tmp_path, learner):
    cfg, lrn = learner
    path = tmp_path / "checkpoint.pt"
    _save(path, cfg, lrn, timesteps=100)
    before = path.read_bytes()
    os.symlink("/dev/full", tmp_path / "checkpoint.tmp")
    with pytest.raises(OSError) as info:
        _save(path, cfg, lrn, timesteps=200)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"[Errno 28] could not write the checkpoint {path} (ENOSPC: No space left on "
        "device); the previous checkpoint is kept"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert path.read_bytes() == before
    assert load_checkpoint(path)["timesteps"] == 100


def test_run_command_exits_4_with_one_line_and_a_status(tmp_path, learner, capsys):
    cfg, lrn = learner
    run = tmp_path / "run"

    def body() -> int:
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"iteration": 1}\n')
        _save(run / "checkpoint.pt", cfg, lrn, timesteps=100)
        os.symlink("/dev/full", run / "checkpoint.tmp")
        _save(run / "checkpoint.pt", cfg, lrn, timesteps=200)
        return harness.DONE

    assert harness.run_command("p", PPOConfig, run, body) == harness.RUNTIME_FAILURE
    line = (
        f"OSError: [Errno 28] could not write the checkpoint {run / 'checkpoint.pt'} "
        "(ENOSPC: No space left on device); the previous checkpoint is kept"
    )
    assert capsys.readouterr().err.splitlines() == [f"p: error: {line}"]
    status = json.loads((run / "status.json").read_text())
    assert status == {"status": "failed", "exit_code": 4, "message": line}
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt", "metrics.jsonl",
                                                     "status.json"]  # fmt: skip


def test_status_file_on_a_full_disk_is_reported_not_raised(tmp_path, capsys):
    run = tmp_path / "run"

    def body() -> int:
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"iteration": 1}\n')
        os.symlink("/dev/full", run / "status.json")
        raise OSError(errno.ENOSPC, "No space left on device", str(run / "metrics.jsonl"))

    assert harness.run_command("p", PPOConfig, run, body) == harness.RUNTIME_FAILURE
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"p: error: OSError: [Errno 28] No space left on device: '{run / 'metrics.jsonl'}'",
        f"{run / 'status.json'} could not be written: [Errno 28] No space left on device",
    ]
    assert not (run / "status.json").exists()
