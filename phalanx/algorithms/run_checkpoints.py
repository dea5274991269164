"""A run folder's checkpoints: the one format PPO and GRPO both write and resume from.

``<run_dir>/checkpoints/step_<n>/`` holds what resuming after step ``n`` (a GRPO step, a
PPO iteration) needs: ``state.json`` with the step, the run's config and the
algorithm's small state, and the algorithm's own files beside it (PPO: ``learner.pt``;
GRPO: ``weights/``, ``optim/``, ``tokenizer/``). A checkpoint is written into
``step_<n>.tmp`` and renamed into place once complete, so a folder named ``step_<n>`` with
a ``state.json`` is whole; anything else under ``checkpoints/`` is not a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from phalanx.algorithms import _harness as harness

STATE_FILE = "state.json"
TMP_SUFFIX = ".tmp"  # a checkpoint being written (renamed into place when complete)


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> str:
    """The folder of the checkpoint after step ``step`` of the run in ``run_dir``."""
    return os.path.join(run_dir, "checkpoints", f"step_{step}")


def complete_checkpoints(run_dir: str | os.PathLike[str]) -> list[str]:
    """The complete checkpoint folders of ``run_dir``, oldest step first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = sorted(
        (int(d.removeprefix("step_")), d)
        for d in os.listdir(root)
        if re.fullmatch(r"step_\d+", d) and os.path.exists(os.path.join(root, d, STATE_FILE))
    )
    return [os.path.join(root, d) for _, d in steps]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint folder of ``run_dir``, or None when it has none."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def remove_unfinished_checkpoints(run_dir: str | os.PathLike[str]) -> None:
    """Remove the ``checkpoints/*.tmp`` folders of ``run_dir``: writes a stopped run left."""
    root = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(root):
        for d in os.listdir(root):
            if d.endswith(TMP_SUFFIX):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def write_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    state: dict[str, Any],
    write_files: Callable[[str], None],
    keep: int | None = None,
) -> str:
    """Write the checkpoint after ``step``: ``write_files(folder)`` writes the algorithm's
    files into the (temporary) folder, then ``state`` (JSON, with ``step`` added) goes into
    its ``state.json`` and the folder is renamed into place.

    Args:
        run_dir: the run folder.
        step: the step (GRPO) or iteration (PPO) the checkpoint follows.
        state: what resuming reads besides the files; must be JSON-serialisable.
        write_files: writes the algorithm's files into the folder it is given.
        keep: how many complete checkpoints to keep, the newest (None: all). Older ones
            are removed only after the new one is in place.

    Returns:
        The checkpoint's folder.

    Raises:
        OSError: a write failed (a full disk, here or on a worker): the error names the
            folder and the errno (``ENOSPC``); the partial folder is removed and the earlier
            checkpoints stay.
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep!r}")
    path = checkpoint_path(run_dir, step)
    tmp = path + TMP_SUFFIX
    try:
        os.makedirs(tmp, exist_ok=True)
        write_files(tmp)
        with open(os.path.join(tmp, STATE_FILE), "w") as f:
            json.dump({**state, "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(path, ignore_errors=True)  # an incomplete one of an earlier try
        os.replace(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        error = harness.os_error_of(e)
        if error is None:
            raise
        raise harness.checkpoint_write_error(path, error) from None
    if keep is not None:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def read_state(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``state.json`` of a checkpoint folder.

    Raises:
        FileNotFoundError: the folder has no ``state.json``.
        ValueError: the file is not valid JSON holding an object with a ``step``.
    """
    path = os.path.join(checkpoint, STATE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint {path} is corrupt or unreadable ({e})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"checkpoint {path} is not a phalanx checkpoint (no step)")
    return state
