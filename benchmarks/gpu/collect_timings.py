"""Write the kit's short timings JSON from the JUnit XML and the benchmarks' log.

    python benchmarks/gpu/collect_timings.py JUNIT_XML BENCH_LOG OUT_JSON [name=seconds ...]

The JSON holds the test counts and the slowest tests, every ``RESULT {...}`` record the
benchmarks printed, and the wall seconds of each phase passed as ``name=seconds``.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any


def junit_summary(path: str, slowest: int = 10) -> dict[str, Any]:
    """Counts (tests, failures, errors, skipped) and the ``slowest`` tests' seconds."""
    if not os.path.exists(path):
        return {"missing": path}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    cases = [
        (f"{c.get('classname')}::{c.get('name')}", float(c.get("time", 0)))
        for s in suites
        for c in s.iter("testcase")
    ]
    cases.sort(key=lambda c: -c[1])
    return {**counts, "slowest_s": {name: round(t, 2) for name, t in cases[:slowest]}}


def bench_records(log_path: str) -> list[dict[str, Any]]:
    """Every ``RESULT {json}`` line of the benchmarks' log, in order."""
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        return [json.loads(line[len("RESULT ") :]) for line in f if line.startswith("RESULT ")]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    junit, log, out, *phases = args
    wall = {}
    for p in phases:
        name, sep, value = p.partition("=")
        if not sep:
            raise SystemExit(f"phase {p!r} is not name=seconds")
        wall[name] = float(value)
    doc = {"tests": junit_summary(junit), "benchmarks": bench_records(log), "wall_s": wall}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
