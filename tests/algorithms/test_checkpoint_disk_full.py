"""A full disk while PPO writes its checkpoint: an error naming the file and ENOSPC, the
previous checkpoint kept, nothing half-written left, exit 4 with ``status.json``.

The full disk is real: the checkpoint's file in its temporary folder (or ``status.json``)
is a symlink to ``/dev/full``, where every write fails with ENOSPC."""

from __future__ import annotations

import errno
import json
import os

import pytest

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.ppo import build_learner, load_checkpoint, save_checkpoint
from phalanx.algorithms.ppo_config import PPOConfig

pytestmark = pytest.mark.timeout(60)


def _save(run_dir, cfg, learner, iteration: int) -> None:
    save_checkpoint(run_dir, learner.policy, learner.optimizer, {}, 100 * iteration, iteration,
                    1, cfg, learner.spaces)  # fmt: skip


def _full_disk_at(run_dir, iteration: int) -> None:
    """Make the learner file of ``iteration``'s checkpoint land on a full disk."""
    target = run_dir / "checkpoints" / f"step_{iteration}.tmp" / "learner.pt"
    target.parent.mkdir(parents=True)
    os.symlink("/dev/full", target)


def _message(run_dir, iteration: int) -> str:
    return (
        f"[Errno 28] could not write the checkpoint {run_dir / 'checkpoints' / f'step_{iteration}'}"
        " (ENOSPC: No space left on device); the previous checkpoint is kept"
    )


@pytest.fixture
def learner():
    cfg = PPOConfig(env="CartPole-v1")
    return cfg, build_learner(cfg, None)


def test_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path, learner):
    cfg, lrn = learner
    _save(tmp_path, cfg, lrn, iteration=1)
    before = (tmp_path / "checkpoints" / "step_1" / "learner.pt").read_bytes()
    _full_disk_at(tmp_path, 2)
    with pytest.raises(OSError) as info:
        _save(tmp_path, cfg, lrn, iteration=2)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == _message(tmp_path, 2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]
    assert (tmp_path / "checkpoints" / "step_1" / "learner.pt").read_bytes() == before
    assert load_checkpoint(tmp_path)["timesteps"] == 100
    # the next write is whole, and only the newest two are kept
    _save(tmp_path, cfg, lrn, iteration=2)
    _save(tmp_path, cfg, lrn, iteration=3)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_2", "step_3"]
    assert load_checkpoint(tmp_path)["timesteps"] == 300


def test_run_command_exits_4_with_one_line_and_a_status(tmp_path, learner, capsys):
    cfg, lrn = learner
    run = tmp_path / "run"

    def body() -> int:
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"iteration": 1}\n')
        _save(run, cfg, lrn, iteration=1)
        _full_disk_at(run, 2)
        _save(run, cfg, lrn, iteration=2)
        return harness.DONE

    assert harness.run_command("p", PPOConfig, run, body) == harness.RUNTIME_FAILURE
    line = f"OSError: {_message(run, 2)}"
    assert capsys.readouterr().err.splitlines() == [f"p: error: {line}"]
    status = json.loads((run / "status.json").read_text())
    assert status == {"status": "failed", "exit_code": 4, "message": line}
    assert sorted(os.listdir(run)) == ["checkpoints", "metrics.jsonl", "status.json"]
    assert sorted(os.listdir(run / "checkpoints")) == ["step_1"]


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
