"""`python -m optimize.docs.figures [--check]`: the table of headline figures in docs/figures.md, made
from the records in docs/figures/*.json.

Each record is one headline figure (SCHEMA): what is measured, the figure, its ratio against a baseline
or a peer where there is one, the date, the CPU (model and features), the load while it was measured
and the command that reproduces it. A benchmark run with `--record PATH` writes one (write_record), so
running a row's command again with that option brings the row up to date.

The table sits in docs/figures.md between two marker comments:

    <!-- figures table (python -m optimize.docs.figures; the rows are docs/figures/*.json) -->
    | ... |
    <!-- end figures table -->

Without `--check` the table is rewritten in place. With `--check` (`make lint` runs it) nothing is
written and the exit code is 1 with one line when the table is stale or its markers are missing. A
record that breaks the schema is refused in one line naming the file and what is wrong (exit 2), and
nothing is written.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from optimize.errors import ArgumentParser

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "figures.md"
RECORDS = ROOT / "docs" / "figures"
COMMAND = "python -m optimize.docs.figures"
BEGIN = "<!-- figures table (python -m optimize.docs.figures; the rows are docs/figures/*.json) -->\n"
END = "<!-- end figures table -->"
BLOCK = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.DOTALL)

_TEXT = {"type": "string", "minLength": 1, "pattern": r"^[^\n]*\S[^\n]*$"}  # one line, not blank
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["measure", "figure", "date", "cpu", "load", "command"],
    "additionalProperties": False,
    "properties": {
        "measure": {**_TEXT, "description": "what is measured, on what model or file"},
        "figure": {**_TEXT, "description": "the figure itself, with its unit"},
        "ratio": {
            "anyOf": [_TEXT, {"type": "null"}],
            "description": "the figure against its baseline or peer, naming it (null: there is none)",
        },
        "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$", "description": "YYYY-MM-DD"},
        "time": {**_TEXT, "description": "the hours it was measured in, UTC"},
        "cpu": {
            "type": "object",
            "required": ["model", "features"],
            "additionalProperties": False,
            "properties": {
                "model": _TEXT,
                "features": _TEXT,
                "cores": {"type": "integer", "minimum": 1},
            },
        },
        "load": {**_TEXT, "description": "what else ran while it was measured (load average, CPU share)"},
        "command": {**_TEXT, "description": "the command that reproduces it"},
        "source": {**_TEXT, "description": "where the figure was first reported"},
    },
}


class RecordError(ValueError):
    """A record that cannot be read or breaks the schema; its message is the one line to show."""


def validate(record: Any, name: str) -> dict:
    """The record itself when it fits SCHEMA, else RecordError naming `name` and the first problem."""
    import jsonschema_rs

    for error in jsonschema_rs.validator_for(SCHEMA).iter_errors(record):
        where = "/".join(str(part) for part in error.instance_path)
        raise RecordError(f"{name}: {where + ': ' if where else ''}{error.message}")
    return record


def read_records(folder: Path = RECORDS) -> list[tuple[str, dict]]:
    """Every record in `folder`, by file name, each checked against SCHEMA."""
    if not folder.is_dir():
        raise RecordError(f"{folder}: no folder of figure records")
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RecordError(f"{path}: not a readable JSON record ({' '.join(str(exc).split())})") from None
        records.append((path.stem, validate(record, str(path))))
    if not records:
        raise RecordError(f"{folder}: no figure records (*.json)")
    return records


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """A command as inline code (a command that holds a backtick takes a double fence)."""
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _row(record: dict) -> list[str]:
    cpu = record["cpu"]
    cores = f", {cpu['cores']} cores" if "cores" in cpu else ""
    when = record["date"] + (f", {record['time']}" if "time" in record else "")
    return [
        record["measure"],
        f"**{record['figure']}**",
        record.get("ratio") or "",
        when,
        f"{cpu['model']}{cores}; {cpu['features']}",
        record["load"],
        _code(record["command"]),
    ]


def table(records: list[tuple[str, dict]]) -> str:
    header = ["what is measured", "figure", "ratio", "date", "CPU (model; features)", "load", "command"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in _row(record)) + " |" for _, record in records]
    return "\n".join(lines) + "\n"


def render(page_text: str, records: list[tuple[str, dict]], page: Path) -> str:
    """The page with its table made from `records`; RecordError when the page has no markers."""
    if len(BLOCK.findall(page_text)) != 1:
        raise RecordError(f"{page}: no figures table, or more than one (its markers: {BEGIN.strip()} ... {END})")
    return BLOCK.sub(lambda _: BEGIN + table(records) + END, page_text)


def _write_atomically(path: Path, text: str) -> None:
    """Replace the file whole: a temporary file beside it renamed over it, so no reader sees half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        # mkstemp makes the file private: it keeps the mode of the file it replaces, else the usual one
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def machine() -> dict:
    """The date, hour, CPU and load a record made now carries (the load average at the end of the
    run: over 1, 5 and 15 minutes, the last covering most runs)."""
    from engines.hardware import CPU_FEATURES, cpu_flags
    from optimize.environment import cpu_model

    now = datetime.datetime.now(datetime.timezone.utc)
    flags = [flag for flag in CPU_FEATURES if flag in cpu_flags()]
    cores = os.cpu_count() or 1
    one, five, fifteen = os.getloadavg()
    return {
        "date": now.date().isoformat(),
        "time": now.strftime("%H:%M UTC, at the end of the run"),
        "cpu": {"model": cpu_model(), "features": ", ".join(flags) or "none of " + ", ".join(CPU_FEATURES)},
        "cores": cores,
        "load": f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min) on {cores} cores",
    }


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that ran `module` with `argv` (sys.argv's when None), as a shell would take it."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", module, *args])


def write_record(
    path: Path, *, measure: str, figure: str, ratio: str | None, module: str, argv: list[str] | None
) -> dict:
    """Write the record of a figure just measured by `module` run with `argv`: the date, CPU and load
    are this machine's now. Checked against SCHEMA before anything is written; the file is replaced
    whole. The table is then brought up to date by `python -m optimize.docs.figures`."""
    here = machine()
    record = {
        "measure": measure,
        "figure": figure,
        "ratio": ratio,
        "date": here["date"],
        "time": here["time"],
        "cpu": {**here["cpu"], "cores": here["cores"]},
        "load": here["load"],
        "command": command_line(module, argv),
    }
    validate(record, str(path))
    path = Path(path)
    _write_atomically(path, json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote the record {path}; {COMMAND} puts it in the table")
    return record


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog=COMMAND, description="Rewrite docs/figures.md's table from docs/figures/*.json.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the table is stale")
    parser.add_argument("--page", type=Path, default=PAGE, help="the page holding the table (docs/figures.md)")
    parser.add_argument("--records", type=Path, default=RECORDS, help="the folder of records (docs/figures/)")
    args = parser.parse_args(argv)
    try:
        records = read_records(args.records)
        text = args.page.read_text(encoding="utf-8")
    except RecordError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(f"error: {args.page}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:
        new = render(text, records, args.page)
    except RecordError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    if new == text:
        return 0
    if args.check:
        print(f"{args.page}: the figures table is stale; run {COMMAND}", file=sys.stderr)
        return 1
    _write_atomically(args.page, new)
    print(f"rewrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
