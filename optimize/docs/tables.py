"""`python -m optimize.docs.tables [--check]`: the tables in docs/ that are made from the code.

- `methods`: every registered method (optimize/registry.py), with its stage, what it takes, the tasks
  it applies to and its summary (the first paragraph of its docstring);
- `gate`: every threshold of the gate's schema (GateConfig in optimize/config.py), with what its check
  reads and how it compares (optimize/gate.py's CHECKS);
- `race`: the engine race's candidates, what each is built with and which races run it by default;
- `layout`: every package of optimize/, engines/, serve/, calibration/ and benchmarks/ and its modules, each with
  the first sentence of its docstring (read from the source, nothing imported);
- `contracts`: the import contracts `make lint` checks (`[tool.importlinter]` in pyproject.toml);
- `serve-fields`: every field of the OpenAI completion and chat request bodies and what the server
  does with it per engine (serve/llm/fields.py), in serve/README.md.

Each table sits in a docs/*.md file (or one of EXTRA_DOCUMENTS) between two marker comments:

    <!-- generated:NAME (python -m optimize.docs.tables) -->
    | ... |
    <!-- end generated:NAME -->

Without `--check` the tables are rewritten in place. With `--check` (`make lint` runs it) nothing is
written, and the exit code is 1 with one line per table that is stale, missing or unknown.
"""

from __future__ import annotations

import ast
import dataclasses
import errno
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from optimize.errors import ArgumentParser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# The code packages, in the order the layout shows them.
PACKAGES = ("optimize", "engines", "serve", "calibration", "benchmarks")
COMMAND = "python -m optimize.docs.tables"
# Documents outside docs/ that hold generated tables too (the serve package's own README).
EXTRA_DOCUMENTS = (ROOT / "serve" / "README.md",)
BLOCK = re.compile(r"(<!-- generated:([\w-]+) .*?-->\n)(.*?)(<!-- end generated:\2 -->)", re.DOTALL)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    """A parameter value as a recipe writes it (YAML flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def _params(params: dict) -> str:
    return ", ".join(f"{k}: {_value(v)}" for k, v in params.items())


def methods_table() -> str:
    from optimize import registry, tasks

    shipped = [tasks.get(name) for name in tasks.names()]
    inputs = {"torch": "PyTorch module", "onnx": "ONNX graph"}
    methods = sorted(registry.all_methods(), key=lambda m: (registry.STAGES.index(m.stage), m.name))
    rows = [
        [
            m.stage,
            f"`{m.name}`",
            inputs[m.input_format],
            "yes" if m.needs_calibration else "",
            _tasks_cell([t.name for t in shipped if m.supports(t)], [t.name for t in shipped if not m.supports(t)]),
            m.summary,
        ]
        for m in methods
    ]
    return _table(["stage", "method", "input", "calibration", "tasks", "what it does"], rows)


def _tasks_cell(supported: list[str], refused: list[str]) -> str:
    if not refused:
        return "every task"
    return f"every task but {', '.join(refused)}" if len(refused) < len(supported) else ", ".join(supported)


def gate_table() -> str:
    from optimize.config import GateConfig
    from optimize.evaluate.benchmark import BUSY_SHARE
    from optimize.gate import CHECKS

    specs = {spec.threshold_key: spec for spec in CHECKS}
    schema = [f.name for f in dataclasses.fields(GateConfig)]
    unknown = sorted(set(specs) - set(schema))
    if unknown:
        raise ValueError(f"optimize/gate.py checks {unknown}, which GateConfig (optimize/config.py) does not have")
    points = {
        "batch": "a batch size or `all`",
        "request": "a request shape, `all` or null (the first)",
        "concurrency": "a number of clients, `all` or null (every level of `workload.concurrency`)",
    }
    rows = [
        [
            f"`gate.{key}`",
            specs[key].metric,
            f"value {specs[key].comparison} threshold",
            f"`gate.{specs[key].selector}`: {points[specs[key].per]}" if specs[key].selector else "",
            "yes" if specs[key].timed else "",
        ]
        for key in schema
        if key in specs
    ]
    note = (
        f"\nA timed check fails as untrusted when other processes used more than {BUSY_SHARE:.0%} of the CPUs"
        " while its figure was measured.\n"
    )
    return _table(["threshold", "what the check reads", "passes when", "checked at", "timed"], rows) + note


def serve_fields_table() -> str:
    from serve.llm.fields import fields_table

    return fields_table()


def race_table() -> str:
    from optimize import tasks
    from optimize.compile.race.candidates import AT_SIZE_GGUF, CANDIDATES, default_candidates
    from optimize.memory.plan import CANDIDATES_BY_SIZE

    generating = ", ".join(f"`{name}`" for name in tasks.names() if tasks.get(name).generates)

    def default_for(name: str) -> str:
        full_precision, gguf = default_candidates(generates=True), default_candidates(generates=True, gguf=True)
        if name in full_precision and name in gguf:
            return generating
        if name in full_precision:
            return f"{generating} from a full-precision source"
        if name in gguf:
            return f"{generating} from a GGUF file"
        if name in AT_SIZE_GGUF:
            above = CANDIDATES_BY_SIZE[0][0] / 1e9
            return f"{generating} from a full-precision source above {above:g}B parameters (the cheapest builds kept)"
        return f"every task but {generating}" if name in default_candidates(generates=False) else "when named"

    rows = [
        [
            f"`{name}`",
            f"`{c.engine}`",
            _params(c.engine_params),
            f"`{c.quantize}`" if c.quantize else "",
            _params(c.quantize_params),
            default_for(name),
        ]
        for name, c in CANDIDATES.items()
    ]
    return _table(["candidate", "engine", "engine params", "quantize", "quantize params", "raced by default"], rows)


def layout_table() -> str:
    """Every package under ROOT and its modules, as the folders hold them: a moved, added or renamed
    module or package makes the table stale."""
    rows: list[list[str]] = []
    for name in PACKAGES:
        rows += _package_rows(ROOT / name)
    return _table(["package or module", "what it holds"], rows)


def _package_rows(folder: Path) -> list[list[str]]:
    rows = [[f"**`{folder.relative_to(ROOT).as_posix()}/`**", _summary(folder / "__init__.py")]]
    rows += [[f"`{p.stem}`", _summary(p)] for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
    for sub in sorted(p for p in folder.iterdir() if (p / "__init__.py").is_file()):
        rows += _package_rows(sub)
    return rows


# A sentence ends at a full stop before a capital, a quote or the end (not at "e.g." or "i.e.").
SENTENCE = re.compile(r"(.+?(?<!e\.g)(?<!i\.e)\.)(?=\s+[A-Z`(\"]|$)")


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = doc.split("\n\n")[0].splitlines()
    # a list that opens the docstring is detail: its heading line is the summary
    heading = [line for i, line in enumerate(lines) if not any(s.startswith("- ") for s in lines[: i + 1])]
    paragraph = " ".join(" ".join(heading).split())
    match = SENTENCE.match(paragraph)
    return match.group(1) if match else paragraph


def contracts_list() -> str:
    """The contracts lint-imports checks, by name, as pyproject.toml declares them."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return "".join(f"- {c['name']} (`{c['type']}`)\n" for c in config["contracts"])


TABLES: dict[str, Callable[[], str]] = {
    "methods": methods_table,
    "gate": gate_table,
    "race": race_table,
    "layout": layout_table,
    "contracts": contracts_list,
    "serve-fields": serve_fields_table,
}


def documents(docs: Path = DOCS) -> list[Path]:
    """The files whose generated tables are kept current: docs/*.md, then EXTRA_DOCUMENTS."""
    return sorted(docs.glob("*.md")) + [path for path in EXTRA_DOCUMENTS if os.path.lexists(path)]


def read_document(path: Path) -> str:
    """The text of a regular UTF-8 file, opened without following a link (a linked .md would have the
    rewrite land outside --docs) and without blocking (a FIFO named *.md would hang the read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("a symbolic link") from None
        raise ValueError(exc.strerror or str(exc)) from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise ValueError("not a regular file")
        raw = file.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start})") from None


def write_document(path: Path, text: str) -> None:
    """Replace the file whole (a temporary file renamed over it: a link put there meanwhile is replaced,
    never followed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(tmp, stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def update(docs: Path = DOCS) -> tuple[dict[Path, str], list[str]]:
    """Every docs/*.md file whose tables differ from the code, with its new text; and the problems,
    one line each (a stale, missing or unknown table)."""
    rendered = {name: render() for name, render in TABLES.items()}
    changed: dict[Path, str] = {}
    problems: list[str] = []
    seen: set[str] = set()
    for path in documents(docs):
        try:
            text = read_document(path)
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: {exc}; not read or rewritten")
            continue

        def replace(match: re.Match, path: Path = path) -> str:
            name = match.group(2)
            if name not in rendered:
                problems.append(f"{path}: unknown generated table {name!r} (known: {', '.join(TABLES)})")
                return match.group(0)
            seen.add(name)
            if match.group(3) != rendered[name]:
                problems.append(f"{path}: the {name!r} table is stale; run {COMMAND}")
            return match.group(1) + rendered[name] + match.group(4)

        new = BLOCK.sub(replace, text)
        if new != text:
            changed[path] = new
    problems += [
        f"{docs}: no generated {name!r} table (its markers are missing)" for name in TABLES if name not in seen
    ]
    return changed, problems


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog=COMMAND, description="Rewrite the tables in docs/ that are made from the code.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale table")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the folder of .md files (default: docs/)")
    args = parser.parse_args(argv)
    changed, problems = update(args.docs)
    if args.check:
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    for path, text in changed.items():
        write_document(path, text)
        print(f"rewrote {path}")
    missing = [line for line in problems if "is stale" not in line]
    for line in missing:
        print(line, file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
