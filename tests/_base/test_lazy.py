"""Public names are declared once per package and imported on first use, safely from
several threads at once (the race shows only on first import: each try is a fresh
process)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import phalanx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = [
    "phalanx",
    "phalanx.cli",
    "phalanx.comm",
    "phalanx.data",
    "phalanx.envs",
    "phalanx.group",
    "phalanx.resources",
    "phalanx.weights",
    "phalanx.worker",
]

# Each thread takes one of these at the same moment: public names of the root and of
# packages, and modules imported directly (what PPO's learner-init thread does).
RACE = """
import importlib, sys, threading
import phalanx
targets = sys.argv[1].split(",")
barrier = threading.Barrier(len(targets))
errors = []
def take(target):
    barrier.wait()
    try:
        module, _, name = target.partition(":")
        value = importlib.import_module(module)
        if name:
            getattr(value, name)
    except BaseException as e:
        errors.append(f"{target}: {type(e).__name__}: {e}")
threads = [threading.Thread(target=take, args=(t,)) for t in targets]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ERRORS", errors)
"""
TARGETS = [
    "phalanx.weights.sender",
    "phalanx.envs:EnvRunnerGroup",
    "phalanx:RayWorkerGroup",
    "phalanx.group:WorkerGroup",
    "phalanx:WeightSender",
    "phalanx:Cluster",
    "phalanx.resources:RayVirtualCluster",
    "phalanx:RayWorkerBuilder",
    "phalanx.group.group",
    "phalanx:Policy",
]


@pytest.mark.timeout(300)
def test_public_names_import_from_many_threads_at_once():
    procs = []  # six fresh processes, run side by side (each is one first import)
    for attempt in range(6):
        targets = TARGETS[attempt % 2 :] + TARGETS[: attempt % 2]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RACE, ",".join(targets)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        for attempt, proc in enumerate(procs):
            stdout, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stderr
            assert stdout.strip().splitlines()[-1] == "ERRORS []", (attempt, stdout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.smoke
def test_all_is_the_declared_table_and_every_name_resolves():
    for package in PACKAGES:
        module = importlib.import_module(package)
        assert module.__all__ == sorted(module.__all__), package
        assert len(set(module.__all__)) == len(module.__all__), package
        for name in module.__all__:
            assert getattr(module, name) is not None, (package, name)
        assert set(module.__all__) <= set(dir(module)), package


@pytest.mark.smoke
def test_unknown_name_is_an_attribute_error_naming_the_package():
    with pytest.raises(AttributeError, match="module 'phalanx.group' has no attribute 'Nope'"):
        assert importlib.import_module("phalanx.group").Nope is None
    with pytest.raises(ImportError, match="cannot import name 'Nope' from 'phalanx'"):
        exec("from phalanx import Nope", {})


def test_package_import_loads_no_submodule():
    script = (
        "import sys, phalanx.group, phalanx.resources, phalanx.envs, phalanx.comm\n"
        "print(sorted(m for m in sys.modules if m.startswith(('phalanx.group.', "
        "'phalanx.resources.', 'phalanx.envs.', 'phalanx.comm.'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    # what the root imports for Worker.create_group (the worker layer needs comm's mixin)
    loaded = eval(proc.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if not m.startswith("phalanx.comm.")] == []
    assert phalanx.__all__ == sorted(phalanx.__all__)
