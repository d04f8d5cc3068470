"""What a Dockerfile installs, read without Docker: its instructions (continuation lines joined,
comments dropped), its ARG defaults, the requirements of every `pip install` (and whether the build
arguments' defaults run it), the Debian packages of `apt-get install`, its ENV and COPY lines."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

GUARD = re.compile(r'if \[ "\$(\w+)" = "?(\w+)"? \]; then')
SHELL_BREAKS = {";", "&&", "||", "|", "fi", ")"}


@dataclass(frozen=True)
class PipInstall:
    requirements: tuple[str, ...]
    options: tuple[str, ...]
    runs_by_default: bool  # False: only a build argument other than its default runs it


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, its text) in order, continuation lines joined."""
    joined: list[str] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    out = []
    for text in (j.strip() for j in joined):
        if text:
            keyword, _, rest = text.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def build_args(path: Path) -> dict[str, str]:
    args = {}
    for keyword, text in instructions(path):
        if keyword == "ARG":
            name, _, default = text.partition("=")
            args[name.strip()] = default.strip()
    return args


def base_images(path: Path) -> list[str]:
    return [text.split()[0] for keyword, text in instructions(path) if keyword == "FROM"]


def env(path: Path) -> dict[str, str]:
    """ENV NAME=VALUE ... (the form these Dockerfiles use)."""
    values = {}
    for keyword, text in instructions(path):
        if keyword == "ENV":
            for pair in shlex.split(text):
                name, _, value = pair.partition("=")
                values[name] = value
    return values


def copies(path: Path) -> list[tuple[str, str]]:
    """(source, destination) of each COPY, relative to the build context and WORKDIR."""
    out = []
    for keyword, text in instructions(path):
        if keyword == "COPY":
            *sources, destination = shlex.split(text)
            out += [(source, destination) for source in sources if not source.startswith("--")]
    return out


def _commands(run: str) -> list[list[str]]:
    """The simple commands of a RUN line, split at the shell's separators."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = []
    current: list[str] = []
    for token in lexer:
        if token in SHELL_BREAKS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in [*commands, current] if c]


def pip_installs(path: Path) -> list[PipInstall]:
    """Every `pip install` of the RUN lines, and whether it runs with the build arguments' defaults."""
    defaults = build_args(path)
    found = []
    for keyword, text in instructions(path):
        if keyword != "RUN":
            continue
        guard = GUARD.search(text)
        runs = guard is None or defaults.get(guard.group(1)) == guard.group(2)
        for command in _commands(text):
            if "pip" in command and "install" in command:
                words = command[command.index("install") + 1 :]
                found.append(
                    PipInstall(
                        tuple(w for w in words if not w.startswith("-")),
                        tuple(w for w in words if w.startswith("-")),
                        runs,
                    )
                )
    return found


def pins(path: Path, by_default_only: bool = True) -> dict[str, str]:
    """{canonical distribution name: version} of every `name==version` requirement."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    out: dict[str, str] = {}
    for install in pip_installs(path):
        if by_default_only and not install.runs_by_default:
            continue
        for text in install.requirements:
            requirement = Requirement(text)
            (spec,) = requirement.specifier
            out[canonicalize_name(requirement.name)] = spec.version
    return out


def apt_packages(path: Path) -> set[str]:
    found = set()
    for keyword, text in instructions(path):
        if keyword != "RUN":
            continue
        for command in _commands(text):
            if "apt-get" in command and "install" in command:
                found |= {w for w in command[command.index("install") + 1 :] if not w.startswith("-")}
    return found
