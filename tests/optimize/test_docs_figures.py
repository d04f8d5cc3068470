"""The table of measured figures in docs/figures.md: current as `make lint` checks it, stale when a record
changes, a record without its date, CPU or command refused in one line, and a benchmark's record read
back into the table."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from optimize.docs import figures


@pytest.fixture
def docs(tmp_path):
    """A copy of the page and its records: (page, records folder)."""
    page, records = tmp_path / "figures.md", tmp_path / "figures"
    shutil.copyfile(figures.PAGE, page)
    shutil.copytree(figures.RECORDS, records)
    return page, records


def run(page, records, *extra):
    return figures.main([*extra, "--page", str(page), "--records", str(records)])


def test_the_table_is_current_as_make_lint_checks_it():
    proc = subprocess.run(
        [sys.executable, "-m", "optimize.docs.figures", "--check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == proc.stderr == ""


def test_every_record_is_a_row_with_its_date_cpu_and_command():
    text = figures.PAGE.read_text()
    records = figures.read_records()
    assert len(records) >= 9
    for _, record in records:
        measure = record["measure"].replace("|", "\\|")
        row = next(line for line in text.splitlines() if line.startswith(f"| {measure} |"))
        assert record["date"] in row and record["cpu"]["model"] in row and record["command"] in row


def test_a_changed_record_makes_the_table_stale_and_a_rewrite_makes_it_current(docs, capsys):
    page, records = docs
    path = records / "kld-vs-llamacpp.json"
    record = json.loads(path.read_text())
    record["figure"] = "Q4_0 0.299, Q8_0 0.00370"
    path.write_text(json.dumps(record))
    before = page.read_text()
    assert run(page, records, "--check") == 1
    assert capsys.readouterr().err.strip() == f"{page}: the figures table is stale; run {figures.COMMAND}"
    assert page.read_text() == before  # --check writes nothing

    assert run(page, records) == 0
    assert capsys.readouterr().out.strip() == f"rewrote {page}"
    assert "**Q4_0 0.299, Q8_0 0.00370**" in page.read_text()
    assert run(page, records, "--check") == 0


def test_an_edited_table_is_stale_too(docs, capsys):
    page, records = docs
    text = page.read_text()
    edited = re.sub(r"\| (\d{4}-\d{2}-\d{2})", "| 1999-01-01", text, count=1)  # one row's date, any row
    assert edited != text
    page.write_text(edited)
    assert run(page, records, "--check") == 1
    assert "the figures table is stale" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda r: r.pop("date"), '"date" is a required property'),
        (lambda r: r.pop("cpu"), '"cpu" is a required property'),
        (lambda r: r.pop("command"), '"command" is a required property'),
        (lambda r: r["cpu"].pop("features"), 'cpu: "features" is a required property'),
        (lambda r: r.update(date="6 December"), 'date: "6 December" does not match'),
        (lambda r: r.update(command="   "), "command: "),
        (lambda r: r.update(speedup=3), "Additional properties are not allowed ('speedup' was unexpected)"),
    ],
)
def test_a_bad_record_is_refused_in_one_line_and_nothing_is_written(docs, capsys, change, problem):
    page, records = docs
    path = records / "native-gguf-decode.json"
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))
    page.write_text(page.read_text().replace("| 1.203x", "| stale 1.203x"))
    before = page.read_text()
    for mode in (["--check"], []):
        assert run(page, records, *mode) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and problem in err, err
        assert page.read_text() == before


def test_unreadable_records_and_a_page_without_markers_are_named(docs, capsys):
    page, records = docs
    (records / "broken.json").write_text("{not json")
    assert run(page, records, "--check") == 2
    assert f"error: {records / 'broken.json'}: not a readable JSON record" in capsys.readouterr().err
    (records / "broken.json").unlink()

    page.write_text(page.read_text().replace(figures.END, ""))
    assert run(page, records) == 1
    assert f"{page}: no figures table" in capsys.readouterr().err


def test_a_benchmarks_record_carries_this_machine_and_its_command_into_the_table(docs, capsys):
    page, records = docs
    path = records / "lm-served-16-clients.json"
    argv = ["ARTIFACT", "--levels", "1,16", "--scenarios", "", "--record", str(path)]
    written = figures.write_record(
        path,
        measure="served to 16 clients",
        figure="700.0 tok/s",
        ratio="3.50x llama-server",
        module="benchmarks.serve_llm_load",
        argv=argv,
    )
    assert json.loads(path.read_text()) == written
    command = f"python -m benchmarks.serve_llm_load ARTIFACT --levels 1,16 --scenarios '' --record {path}"
    assert written["command"] == command
    assert written["load"].startswith("load average ") and written["cpu"]["model"]
    assert run(page, records, "--check") == 1
    capsys.readouterr()
    assert run(page, records) == 0
    row = next(line for line in page.read_text().splitlines() if line.startswith("| served to 16 clients |"))
    assert "**700.0 tok/s**" in row and written["date"] in row and written["command"] in row


def test_a_record_that_breaks_the_schema_is_never_written(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(figures.RecordError, match="measure: "):
        figures.write_record(path, measure="", figure="1", ratio=None, module="benchmarks.x", argv=[])
    assert not path.exists()
