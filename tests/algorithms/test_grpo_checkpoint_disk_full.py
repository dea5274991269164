"""A full disk while GRPO writes ``checkpoints/step_<n>``: an error naming the folder and
ENOSPC, whichever process met it (a policy rank, rank 0 alone, the driver), the previous
checkpoint kept and loadable, nothing half-written left, exit 4 with ``status.json``; a
folder a stopped write left is not read by ``--resume`` and is removed.

The full disk is real: one file of the checkpoint's temporary folder is a symlink to
``/dev/full``, where every write fails with ENOSPC."""

from __future__ import annotations

import errno
import json
import os

import pytest

from phalanx.algorithms import _harness as harness
from phalanx.algorithms.grpo_config import GRPOConfig
from phalanx.algorithms.grpo_run import save_checkpoint, start_run
from phalanx.algorithms.grpo_tasks import make_task
from phalanx.algorithms.run_checkpoints import latest_checkpoint
from phalanx.llm.policy import Policy

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def policy(cluster, model_path, tokenizer):
    """Two FSDP ranks of the tiny model: rank 0 alone writes the tokenizer."""
    cfg = {
        "model_name": str(model_path),
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "logprob_batch_size": 2,
        "max_total_sequence_length": 32,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-3}},
    }
    pol = Policy(cluster, cfg, tokenizer, num_workers=2, name_prefix="ckpt-full")
    yield pol
    pol.shutdown()


def _cfg(run_dir) -> GRPOConfig:
    return GRPOConfig.tiny(run_dir=str(run_dir), progress=False)


def _task(cfg: GRPOConfig):
    return make_task(cfg.task, cfg.seed, cfg.eval_size, cfg.reward, cfg.format_reward)


def _full_disk_at(run_dir, step: int, file: str) -> None:
    """Make ``file`` of ``step``'s checkpoint land on a full disk."""
    target = run_dir / "checkpoints" / f"step_{step}.tmp" / file
    target.parent.mkdir(parents=True)
    os.symlink("/dev/full", target)


def _message(run_dir, step: int) -> str:
    return (
        f"[Errno 28] could not write the checkpoint {run_dir / 'checkpoints' / f'step_{step}'} "
        "(ENOSPC: No space left on device); the previous checkpoint is kept"
    )


@pytest.mark.parametrize(
    "file",
    [
        "weights/__1_0.distcp",  # rank 1's shard (dcp gathers every rank's failure)
        "tokenizer/tokenizer.json",  # rank 0 alone writes it (with Rust, not Python)
        "state.json",  # the driver's part
    ],
)
def test_full_disk_names_the_folder_and_keeps_the_previous_checkpoint(tmp_path, policy, file):
    cfg = _cfg(tmp_path)
    task = _task(cfg)
    save_checkpoint(cfg, policy, task, 1)
    _full_disk_at(tmp_path, 2, file)
    with pytest.raises(OSError) as info:
        save_checkpoint(cfg, policy, task, 2)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == _message(tmp_path, 2)
    step_1 = tmp_path / "checkpoints" / "step_1"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]
    assert latest_checkpoint(str(tmp_path)) == str(step_1)
    assert json.loads((step_1 / "state.json").read_text())["step"] == 1
    policy.load_checkpoint(str(step_1 / "weights"), str(step_1 / "optim"))
    # every rank left the failed write: the next checkpoint is written whole
    save_checkpoint(cfg, policy, task, 2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1", "step_2"]
    assert sorted(os.listdir(tmp_path / "checkpoints" / "step_2")) == [
        "optim",
        "state.json",
        "tokenizer",
        "weights",
    ]


def test_run_command_exits_4_with_one_line_and_a_status(tmp_path, policy, capsys):
    run = tmp_path / "run"
    cfg = _cfg(run)
    task = _task(cfg)

    def body() -> int:
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        save_checkpoint(cfg, policy, task, 1)
        _full_disk_at(run, 2, "weights/__0_0.distcp")
        save_checkpoint(cfg, policy, task, 2)
        return harness.DONE

    assert harness.run_command("g", GRPOConfig, run, body) == harness.RUNTIME_FAILURE
    line = f"OSError: {_message(run, 2)}"
    assert capsys.readouterr().err.splitlines() == [f"g: error: {line}"]
    status = json.loads((run / "status.json").read_text())
    assert status == {"status": "failed", "exit_code": 4, "message": line}
    assert sorted(os.listdir(run)) == ["checkpoints", "metrics.jsonl", "status.json"]
    assert sorted(os.listdir(run / "checkpoints")) == ["step_1"]


def test_resume_ignores_and_removes_an_unfinished_checkpoint(tmp_path):
    for name, step in (("step_1", 1), ("step_2.tmp", 2)):  # step 2's write was stopped
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
        (tmp_path / "checkpoints" / name / "state.json").write_text(json.dumps({"step": step}))
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_1")
    _, _, ckpt = start_run(GRPOConfig.tiny(run_dir=str(tmp_path), resume=True))
    assert ckpt == str(tmp_path / "checkpoints" / "step_1")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]


def test_only_errors_with_an_errno_are_read_as_a_failed_write():
    from phalanx._base.errors import GroupTimeoutError, WorkerError

    def worker_error(cause_type: str, message: str) -> WorkerError:
        return WorkerError("g", 1, "save_checkpoint", "Traceback ...", cause_type, message)

    full = harness.os_error_of(worker_error("OSError", "[Errno 28] No space left on device: 'x'"))
    assert (type(full), full.errno, full.strerror) == (OSError, 28, "No space left on device")
    denied = harness.os_error_of(worker_error("PermissionError", "[Errno 13] Permission denied"))
    assert (denied.errno, denied.strerror) == (13, "Permission denied")
    assert harness.os_error_of(worker_error("ValueError", "[Errno 28] looks like one")) is None
    assert harness.os_error_of(worker_error("OSError", "no errno")) is None
    assert harness.os_error_of(GroupTimeoutError("g", "save_checkpoint", [1], 5.0)) is None
    own = OSError(errno.ENOSPC, "No space left on device")
    assert harness.os_error_of(own) is own
