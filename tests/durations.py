"""Where the suite's time goes, from pytest's JUnit XML (``--junitxml``): markdown tables of
seconds per package (tests/<package>/), per file and the slowest tests, for docs/testing.md.

    python -m pytest --junitxml=/tmp/junit.xml
    python -m tests.durations /tmp/junit.xml [--files 20] [--tests 25]

Each test's time is its set-up, call and tear-down (JUnit's default ``total``), so a
session fixture's cost (the shared Ray's start, the tiny model) counts in the first test
that asks for it.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def read(path: str) -> list[tuple[str, str, float, str]]:
    """(file, test, seconds, outcome) per test case."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")
        if not module:  # a test cut short (the run was interrupted)
            continue
        parts = module.split(".")
        # classname: tests.pkg.test_file[.Class]; keep the module part as a path
        n = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        file = "/".join(parts[: n + 1]) + ".py"
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = tag
        out.append((file, case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return out


def package(file: str) -> str:
    parts = file.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else file


def table(rows: list[tuple[str, str, float, str]], files: int, tests: int) -> str:
    by_pkg: dict[str, list[float]] = defaultdict(list)
    by_file: dict[str, list[float]] = defaultdict(list)
    for file, _, seconds, outcome in rows:
        if outcome != "skipped":
            by_pkg[package(file)].append(seconds)
            by_file[file].append(seconds)
    total = sum(s for _, _, s, _ in rows)
    lines = ["| package | tests run | seconds | share |", "|---|---:|---:|---:|"]
    for pkg, secs in sorted(by_pkg.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {pkg} | {len(secs)} | {sum(secs):.0f} | {sum(secs) / total:.0%} |")
    ran = sum(len(s) for s in by_pkg.values())
    lines.append(f"| **total** | {ran} | {total:.0f} | |")
    lines += ["", "| file | tests run | seconds |", "|---|---:|---:|"]
    for file, secs in sorted(by_file.items(), key=lambda kv: -sum(kv[1]))[:files]:
        lines.append(f"| {file} | {len(secs)} | {sum(secs):.0f} |")
    lines += ["", "| test | seconds |", "|---|---:|"]
    for file, name, seconds, _ in sorted(rows, key=lambda r: -r[2])[:tests]:
        lines.append(f"| {file}::{name} | {seconds:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", help="pytest --junitxml output")
    parser.add_argument("--files", type=int, default=20, help="slowest files to list")
    parser.add_argument("--tests", type=int, default=25, help="slowest tests to list")
    args = parser.parse_args(argv)
    print(table(read(args.junit), args.files, args.tests))


if __name__ == "__main__":
    main()
