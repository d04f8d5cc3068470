"""What a benchmark is given, checked first: the artifact (its manifest, its files, its tokenizer) and
the files its report goes to. Bad input is one line on stderr and exit 2, before any server starts or
anything is timed: a benchmark of a half-copied or edited artifact would time something other than
what it names, and a report path that cannot be written would lose minutes of figures at the end."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn


def refuse(message: str) -> NoReturn:
    """Bad input: one line on stderr, exit 2, before anything has started."""
    from serve.arguments import fail

    fail(message)


def artifact_manifest(folder: Path, serves: str | None = None) -> dict:
    """The artifact's manifest, after engines.artifact has checked it (its shape and its own digest) and
    every file it lists; where `serves` is given ("causal_lm", "encoder"), its engine must serve that."""
    from engines import formats
    from engines.artifact import ArtifactError, read_manifest, verify

    try:
        manifest = read_manifest(folder)
        problems = verify(folder)
    except ArtifactError as exc:
        refuse(str(exc))
    except OSError as exc:
        refuse(f"{folder}: unreadable manifest or files ({type(exc).__name__}: {exc.strerror or exc})")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        refuse(f"{folder} does not match its manifest: {problems[0]}{more}")
    engine_format = (manifest.get("engine") or {}).get("format")
    found = formats.FORMATS.get(engine_format or "")
    if serves and (found is None or found.serves != serves):
        refuse(f"{folder}: its engine ({engine_format}) does not serve {serves}, which this benchmark times")
    return manifest


def artifact_tokenizer(artifact: Path):
    """The artifact's tokenizer.json (both GenAI engines' folders carry one): encode and decode."""
    from tokenizers import Tokenizer

    found = sorted(artifact.rglob("tokenizer.json"))
    if not found:
        refuse(f"{artifact} has no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(found[0]))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
        refuse(f"{found[0]}: not a tokenizer the tokenizers library reads ({str(exc)[:120]})")
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), tokenizer.decode


def refuse_unwritable(*reports: Path | str | None) -> None:
    """Each report file given (None: not asked; "-": stdout) can be written: not a folder, in a folder
    that exists and takes new files."""
    for report in reports:
        if report is None or str(report) == "-":
            continue
        path = Path(report)
        if path.is_dir():
            refuse(f"{path} is a folder; give the file the report should be written to")
        if not path.parent.is_dir():
            refuse(f"{path}: there is no folder {path.parent} to write it in")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            refuse(f"{path}: not writable")
