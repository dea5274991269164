"""The one checkpoint folder format PPO and GRPO write: whole or absent, the newest kept,
a failed write leaving the earlier checkpoints, and each algorithm refusing the other's."""

from __future__ import annotations

import errno
import json
import os

import pytest

from phalanx.algorithms.ppo import load_checkpoint
from phalanx.algorithms.run_checkpoints import (
    checkpoint_path,
    latest_checkpoint,
    read_state,
    remove_unfinished_checkpoints,
    write_checkpoint,
)

pytestmark = pytest.mark.timeout(60)


def _write_text(name: str, text: str):
    def write_files(folder: str) -> None:
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)

    return write_files


def test_a_checkpoint_is_a_step_folder_with_its_state(tmp_path):
    path = write_checkpoint(tmp_path, 3, {"x": [1, 2]}, _write_text("a.txt", "three"))
    assert path == checkpoint_path(tmp_path, 3) == str(tmp_path / "checkpoints" / "step_3")
    assert sorted(os.listdir(path)) == ["a.txt", "state.json"]
    assert read_state(path) == {"x": [1, 2], "step": 3}
    assert latest_checkpoint(tmp_path) == path


def test_keep_removes_the_oldest_only_after_the_new_one_is_in_place(tmp_path):
    for step in (2, 10, 7):  # the order is the steps', not the names'
        write_checkpoint(tmp_path, step, {}, _write_text("a.txt", str(step)), keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_10", "step_7"]
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoints" / "step_10")
    write_checkpoint(tmp_path, 10, {}, _write_text("a.txt", "again"), keep=2)  # rewritten
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_10", "step_7"]
    assert (tmp_path / "checkpoints" / "step_10" / "a.txt").read_text() == "again"
    with pytest.raises(ValueError, match="keep must be >= 1 or None, got 0"):
        write_checkpoint(tmp_path, 11, {}, _write_text("a.txt", ""), keep=0)


def test_a_failed_write_names_the_folder_and_leaves_no_partial_one(tmp_path):
    write_checkpoint(tmp_path, 1, {}, _write_text("a.txt", "one"))

    def full_disk(folder: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        write_checkpoint(tmp_path, 2, {}, full_disk, keep=1)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (
        f"[Errno 28] could not write the checkpoint {tmp_path / 'checkpoints' / 'step_2'} "
        "(ENOSPC: No space left on device); the previous checkpoint is kept"
    )
    assert os.listdir(tmp_path / "checkpoints") == ["step_1"]

    def bug(folder: str) -> None:
        raise KeyError("not a write error")

    with pytest.raises(KeyError):  # anything but a failed write keeps its own type
        write_checkpoint(tmp_path, 2, {}, bug)
    assert os.listdir(tmp_path / "checkpoints") == ["step_1"]


def test_unfinished_and_stateless_folders_are_not_checkpoints(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    write_checkpoint(tmp_path, 1, {}, _write_text("a.txt", ""))
    (tmp_path / "checkpoints" / "step_5.tmp").mkdir()  # a stopped write
    (tmp_path / "checkpoints" / "step_5.tmp" / "state.json").write_text('{"step": 5}')
    (tmp_path / "checkpoints" / "step_6").mkdir()  # no state.json
    (tmp_path / "checkpoints" / "notes").mkdir()
    assert latest_checkpoint(tmp_path) == str(tmp_path / "checkpoints" / "step_1")
    remove_unfinished_checkpoints(tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["notes", "step_1", "step_6"]


def test_read_state_refuses_what_is_not_a_checkpoint_state(tmp_path):
    (tmp_path / "state.json").write_text('{"step": 2')
    with pytest.raises(ValueError, match=f"checkpoint {tmp_path / 'state.json'} is corrupt"):
        read_state(tmp_path)
    (tmp_path / "state.json").write_text(json.dumps({"config": {}}))
    with pytest.raises(ValueError, match="is not a phalanx checkpoint \\(no step\\)"):
        read_state(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_state(tmp_path / "absent")


def test_ppo_refuses_a_grpo_checkpoint_by_name(tmp_path):
    path = write_checkpoint(tmp_path, 4, {"config": {}}, _write_text("weights.bin", ""))
    with pytest.raises(ValueError, match=f"checkpoint {path} is not a PPO checkpoint"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no PPO checkpoint under"):
        load_checkpoint(tmp_path / "other")
