"""The order in which `pytest -n 2 --dist loadfile` hands test files to its workers: heaviest first.

xdist gives a worker a whole file at a time and, left to itself, queues the files by their number of
tests, so a file of a few end-to-end runs (minutes each) comes last and one worker runs it alone while
the other is idle. Queued by recorded time instead, the long files start at once and the short ones
fill in around them (longest-first is within a third of the best split of the work).

The times are each file's seconds in a full run, kept in file_seconds.json beside this module. A file
it does not list (a new one) queues after those it does. Rewrite it from a run's JUnit report:

    python -m pytest -n 2 --dist loadfile --junitxml=/tmp/suite.xml
    python -m tests.support.schedule /tmp/suite.xml
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Sequence

import pytest

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def recorded_seconds() -> dict[str, float]:
    """Each test file's seconds in the last recorded run, by its path under tests/."""
    return json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}


def heaviest_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items with the files in order of recorded time, longest first; within a file, and among
    files with no record, the collection's own order (a module's fixtures rely on it)."""
    seconds = recorded_seconds()
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item), len(first_seen))

    def key(item: pytest.Item) -> tuple[float, int]:
        name = _file_of(item)
        return (-seconds.get(name.removeprefix("tests/"), 0.0), first_seen[name])

    return sorted(items, key=key)  # stable: a file's items keep their order


def _file_of(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]  # the file's path from the root folder: tests/optimize/test_x.py


def file_seconds_of(junit: Path) -> dict[str, float]:
    """Per-file totals of a pytest JUnit report (each testcase's classname is its module's dotted path,
    then its class, if any)."""
    import xml.etree.ElementTree as ET

    totals: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()  # a test class's name
        if parts and parts[0] == "tests":
            totals["/".join(parts[1:]) + ".py"] += float(case.get("time") or 0)
    return {name: round(seconds, 1) for name, seconds in totals.most_common()}


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.schedule JUNIT_XML", file=sys.stderr)
        return 2
    junit = Path(argv[0])
    try:
        totals = file_seconds_of(junit)
    except (OSError, SyntaxError) as exc:  # ET.ParseError is a SyntaxError
        print(f"error: cannot read the JUnit report {junit}: {exc}", file=sys.stderr)
        return 2
    if not totals:
        print(f"error: the JUnit report {junit} has no test of tests/", file=sys.stderr)
        return 2
    FILE_SECONDS.write_text(json.dumps(totals, indent=1) + "\n")
    print(f"{FILE_SECONDS}: {len(totals)} files, {sum(totals.values()) / 60:.1f} minutes in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
