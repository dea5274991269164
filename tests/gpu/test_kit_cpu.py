"""The GPU kit's CPU-runnable parts: wheel splitting, batch planning, reassembly,
argument handling, the timings JSON, and the skip logic of the GPU tests. Not marked
``gpu``: CI runs these. Nothing here touches the network."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.gpu import skips

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))

import collect_timings  # noqa: E402
import prepare_wheels  # noqa: E402
import wheelkit  # noqa: E402

MIB = 1 << 20


def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def test_split_then_reassemble_is_byte_identical(tmp_path):
    data = os.urandom(2500)
    src = _write(tmp_path / "pkg-1.0-py3-none-any.whl", data)
    parts = wheelkit.split_file(src, 1000, str(tmp_path / "parts"))
    assert [os.path.basename(p) for p in parts] == [
        f"pkg-1.0-py3-none-any.whl.part{i:03d}" for i in range(3)
    ]
    assert [os.path.getsize(p) for p in parts] == [1000, 1000, 500]
    manifest = {
        "pkg-1.0-py3-none-any.whl": {
            "sha256": wheelkit.sha256(src),
            "parts": [os.path.basename(p) for p in parts],
        }
    }
    (out,) = wheelkit.reassemble(str(tmp_path / "parts"), manifest, str(tmp_path / "out"))
    with open(out, "rb") as f:
        assert f.read() == data
    # an exact multiple of the part size gives no empty trailing part
    even = wheelkit.split_file(
        _write(tmp_path / "even.whl", data[:2000]), 1000, str(tmp_path / "p2")
    )
    assert [os.path.getsize(p) for p in even] == [1000, 1000]


def test_reassemble_names_a_missing_part_and_a_wrong_digest(tmp_path):
    src = _write(tmp_path / "a.whl", os.urandom(300))
    parts = [os.path.basename(p) for p in wheelkit.split_file(src, 100, str(tmp_path / "s"))]
    good = {"a.whl": {"sha256": wheelkit.sha256(src), "parts": parts}}
    os.remove(tmp_path / "s" / parts[1])
    with pytest.raises(
        FileNotFoundError, match=r"a\.whl: parts not carried yet: \['a\.whl\.part001'\]"
    ):
        wheelkit.reassemble(str(tmp_path / "s"), good, str(tmp_path / "o"))
    wheelkit.split_file(src, 100, str(tmp_path / "s"))
    bad = {"a.whl": {"sha256": "0" * 64, "parts": parts}}
    with pytest.raises(ValueError, match=r"a\.whl: SHA-256"):
        wheelkit.reassemble(str(tmp_path / "s"), bad, str(tmp_path / "o"))


def test_plan_batches_first_fit_decreasing_under_the_budget():
    sizes = {"a": 40, "b": 30, "c": 20, "d": 10, "e": 5}
    assert wheelkit.plan_batches(sizes, 50) == [["a", "d"], ["b", "c"], ["e"]]
    assert wheelkit.plan_batches(sizes, 105) == [["a", "b", "c", "d", "e"]]
    with pytest.raises(ValueError, match=r"\['a'\] \(split them\)"):
        wheelkit.plan_batches(sizes, 39)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
            wheelkit.plan_batches(sizes, bad)


def test_plan_of_the_real_wheel_sizes_fits_two_carries():
    # ray 2.60's cp312 wheel (79 MB) in 27 MiB parts, and the small wheels beside it
    ray = 79_000_000
    sizes = {f"ray.part{i:03d}": min(27 * MIB, ray - i * 27 * MIB) for i in range(3)}
    sizes |= {"jsonschema.whl": 90_000, "rpds_py.whl": 390_000, "gymnasium.whl": 960_000}
    sizes |= {"tyro.whl": 180_000, "referencing.whl": 27_000, "typeguard.whl": 35_000}
    batches = wheelkit.plan_batches(sizes, 56 * MIB)
    assert len(batches) == 2
    assert sorted(n for b in batches for n in b) == sorted(sizes)
    assert all(sum(sizes[n] for n in b) <= 56 * MIB for b in batches)


def test_pack_writes_batches_with_the_manifest_and_install_waits_for_every_part(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    blobs = {
        "big-1.0-py3-none-any.whl": os.urandom(5000),
        "small-2.0-py3-none-any.whl": os.urandom(700),
    }
    for name, data in blobs.items():
        _write(wheels / name, data)
    (wheels / "notes.txt").write_text("not a wheel")
    batches = prepare_wheels.pack(str(wheels), str(tmp_path), 2000, 4096 + 4096 + 1024)
    assert [os.path.basename(b) for b in batches] == ["batch1", "batch2"]
    manifests = []
    for b in batches:
        assert os.path.getsize(os.path.join(b, "manifest.json")) > 0
        with open(os.path.join(b, "manifest.json")) as f:
            manifests.append(json.load(f))
        assert sum(os.path.getsize(os.path.join(b, f)) for f in os.listdir(b)) <= 4096 + 4096 + 1024
    assert manifests[0] == manifests[1]
    assert sorted(manifests[0]) == sorted(blobs)
    assert len(manifests[0]["big-1.0-py3-none-any.whl"]["parts"]) == 3
    stage = tmp_path / "stage"
    # one batch carried: nothing is installed yet (install returns None before any pip run)
    assert wheelkit.install(batches[0], str(stage), str(tmp_path / "site"), ROOT) is None
    for b in batches[1:]:
        for f in os.listdir(b):
            os.replace(os.path.join(b, f), stage / f)
    out = wheelkit.reassemble(str(stage), manifests[0], str(tmp_path / "joined"))
    for path in out:
        with open(path, "rb") as f:
            assert f.read() == blobs[os.path.basename(path)]


def test_prepare_wheels_arguments(tmp_path, capsys):
    for argv, message in [
        (["--budget-mib", "64"], "--budget-mib must be < 64"),
        (["--budget-mib", "0"], "--budget-mib must be >= 1, got 0"),
        (
            ["--part-mib", "40", "--budget-mib", "30"],
            "--part-mib 40 must not exceed --budget-mib 30",
        ),
        (["--part-mib", "x"], "invalid int value: 'x'"),
        (["--unknown"], "unrecognized arguments: --unknown"),
    ]:
        with pytest.raises(SystemExit) as e:
            prepare_wheels.parse_args(argv)
        assert e.value.code == 2
        assert message in capsys.readouterr().err
    dest = tmp_path / "dest"
    assert (
        prepare_wheels.main(["--dest", str(dest), "--dry-run", "--packages", "ray", "nope-pkg"])
        == 0
    )
    cmd = capsys.readouterr().out.split()
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert cmd[cmd.index("--implementation") + 1] == "cp"
    assert cmd[cmd.index("-d") + 1] == str(dest / "wheels")
    import ray

    assert cmd[-2:] == [f"ray=={ray.__version__}", "nope-pkg"]  # pinned when installed here
    assert not dest.exists()  # a dry run downloads and writes nothing


def test_wheelkit_install_names_a_missing_batch(capsys):
    with pytest.raises(SystemExit):
        wheelkit.main(["install", "/no/such/batch"])
    assert "batch_dir '/no/such/batch' is not a directory" in capsys.readouterr().err


def test_collect_timings_reads_junit_and_result_lines(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.gpu.test_a" name="t1" time="2.5"/>'
        '<testcase classname="tests.gpu.test_a" name="t2" time="0.25"/>'
        '<testcase classname="tests.gpu.test_b" name="t3" time="7"/>'
        "</testsuite></testsuites>"
    )
    log = tmp_path / "bench.log"
    log.write_text(
        'noise\nRATIO x = 1.0 (a 1)\nRESULT {"bench": "b", "ratio": 1.5}\nRESULT {"bench": "c"}\n'
    )
    out = tmp_path / "timings.json"
    assert (
        collect_timings.main([str(junit), str(log), str(out), "tests=12", "benchmarks=30.5"]) == 0
    )
    doc = json.loads(out.read_text())
    assert doc["tests"] == {
        "tests": 3,
        "failures": 1,
        "errors": 0,
        "skipped": 1,
        "slowest_s": {
            "tests.gpu.test_b::t3": 7.0,
            "tests.gpu.test_a::t1": 2.5,
            "tests.gpu.test_a::t2": 0.25,
        },
    }
    assert doc["benchmarks"] == [{"bench": "b", "ratio": 1.5}, {"bench": "c"}]
    assert doc["wall_s"] == {"tests": 12.0, "benchmarks": 30.5}
    assert (
        collect_timings.main([str(tmp_path / "none.xml"), str(tmp_path / "none.log"), str(out)])
        == 0
    )
    assert json.loads(out.read_text())["tests"] == {"missing": str(tmp_path / "none.xml")}
    with pytest.raises(SystemExit, match="phase 'tests' is not name=seconds"):
        collect_timings.main([str(junit), str(log), str(out), "tests"])


def test_skip_reasons_name_what_is_missing():
    assert skips.skip_reason(1, have_gpus=0, have_ray=True) == skips.NO_CUDA
    assert skips.skip_reason(2, have_gpus=0, have_ray=False) == skips.NO_CUDA
    assert skips.skip_reason(2, have_gpus=1, have_ray=True) == (
        "needs 2 GPUs (one GPU cannot hold two NCCL ranks), torch sees 1"
    )
    assert skips.skip_reason(1, have_gpus=1, have_ray=False) == skips.NO_RAY
    assert skips.skip_reason(2, have_gpus=2, have_ray=True) is None


def test_gpu_tests_collect_without_ray_and_skip_without_cuda():
    """As run_kit.sh runs them (``--confcutdir tests/gpu``), with ``ray`` made unimportable:
    every gpu test is collected and skips with its reason; nothing else is selected."""
    code = (
        "import sys; sys.modules['ray'] = None; import pytest; "
        "sys.exit(pytest.main(['-m', 'gpu', 'tests/gpu', '--confcutdir', 'tests/gpu', "
        "'-p', 'no:cacheprovider', '-q', '-rs']))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=150
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "error" not in out.lower(), out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all(skips.NO_CUDA in line for line in skipped), out
    total = sum(int(line.split("[")[1].split("]")[0]) for line in skipped)
    assert re.search(rf"\n{total} skipped, \d+ deselected in ", out), out
    assert total == skips.KIT_TESTS


def _phalanx_imports(path: str) -> list[tuple[str, str | None]]:
    """``(module, name)`` for every phalanx import in ``path`` (name None: ``import m``)."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("phalanx"):
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith("phalanx")]
    return found


def test_every_phalanx_import_of_the_kit_resolves():
    """The GPU tests import inside their bodies, after the CUDA skip: without this, a moved
    module breaks them only on a GPU machine (it did once: ``phalanx.llm.tiny_task``)."""
    import glob
    import importlib

    files = sorted(
        glob.glob(os.path.join(ROOT, "tests", "gpu", "*.py"))
        + glob.glob(os.path.join(ROOT, "benchmarks", "gpu", "*.py"))
    )
    checked, broken = 0, []
    for path in files:
        for module, name in _phalanx_imports(path):
            checked += 1
            try:
                mod = importlib.import_module(module)
                if name is not None and not hasattr(mod, name):
                    importlib.import_module(f"{module}.{name}")
            except ImportError as e:
                broken.append(f"{os.path.relpath(path, ROOT)}: {module} {name}: {e}")
    assert checked > 20
    assert broken == []
