"""The typed pieces every command line of the project parses with (`python -m serve`, `python -m
serve.ray`, the scripts in benchmarks/): a value that is not what the flag takes (zero or a negative
count, NaN, inf, a number past any sane bound, a list with a bad or unknown item, a path that is not
there, a URL that does not parse) is one line `error: ...` on stderr and exit 2, before any server
starts or anything is measured. Light on purpose: importing it loads no model runtime."""

from __future__ import annotations

import argparse
import ipaddress
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from serve.config import LIMITS, number_problem

# A DNS label (RFC 1123; underscores too, which container runtimes put in service names).
HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def one_line(message: str) -> str:
    """A message that stays on one line whatever text from the command line it quotes: line breaks
    and other control characters are written as escapes."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in str(message))


def fail(message: str) -> NoReturn:
    """Bad input: one line on stderr, exit 2."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but its refusals are one line `error: ...` (no usage block) and exit 2."""

    def error(self, message):
        fail(message)


def number(kind, low, inclusive: bool, high=None) -> Callable[[str], Any]:
    """An argparse type: a finite number of `kind` above `low` (or at least `low`), at most `high`."""

    def parse(text):
        try:
            value = kind(text)
        except (ValueError, OverflowError):  # int() refuses over 4300 digits with a ValueError too
            raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
        problem = number_problem(value, kind, low, inclusive, high)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    return parse


def positive(kind, high=None) -> Callable[[str], Any]:
    """An argparse type: a finite number of `kind` above 0 (and at most `high`)."""
    return number(kind, 0, inclusive=False, high=high)


def count(high: int, low: int = 1) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` (default 1) to `high`."""
    return number(int, low, inclusive=True, high=high)


def seconds(high: float = 86400.0) -> Callable[[str], float]:
    """An argparse type: a duration above 0 s, at most `high` (a day by default: longer overflows
    the timers of threads and sockets, and no run here should wait that long on one thing)."""
    return number(float, 0, inclusive=False, high=high)


def fraction(text: str) -> float:
    """An argparse type: a share from 0 to 1."""
    return number(float, 0, inclusive=True, high=1)(text)


def setting(name: str) -> Callable[[str], Any]:
    """An argparse type for a setting a recipe may carry too: checked as the plan checks the recipe's."""
    kind, low, inclusive, high = LIMITS[name]
    return number(kind, low, inclusive, high)


def number_list(kind, low, high, inclusive: bool = True, most: int = 64) -> Callable[[str], list]:
    """An argparse type: comma-separated numbers (at least one, at most `most`), each checked as
    `number(kind, low, inclusive, high)` checks one: `1,4,16`; not `-1,2`, `4,,8` or ``."""
    one = number(kind, low, inclusive, high)

    def parse(text: str) -> list:
        items = text.split(",")
        if not text.strip() or len(items) > most:
            raise argparse.ArgumentTypeError(f"give 1 to {most} comma-separated numbers, got {text[:40]!r}")
        values = []
        for item in items:
            try:
                values.append(one(item.strip()))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"item {item[:40]!r}: {exc}") from None
        return values

    return parse


def joined(parse: Callable[[str], list]) -> Callable[[str], str]:
    """An argparse type: a list `parse` checks, given back as the comma-separated text (for code
    that reads the flag's text itself)."""
    return lambda text: ",".join(map(str, parse(text)))


def weights(text: str) -> dict[str, float]:
    """An argparse type: a mix of batch sizes, "1:0.7,32:0.3" (each size a whole number from 1, each
    weight a finite number above 0)."""
    size, weight = count(1 << 20), positive(float)
    mix = {}
    for item in text.split(","):
        b, colon, w = item.partition(":")
        if not colon:
            raise argparse.ArgumentTypeError(f"item {item[:40]!r}: give SIZE:WEIGHT, as in 1:0.7,32:0.3")
        try:
            mix[str(size(b.strip()))] = weight(w.strip())
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"item {item[:40]!r}: {exc}") from None
    return mix


def names(known: Sequence[str], empty: bool = False) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names, each one of `known` (`empty`: '' means none)."""

    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",")] if text.strip() else []
        if not items and not empty:
            raise argparse.ArgumentTypeError(f"give one or more of {','.join(known)}")
        unknown = [item for item in items if item not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown[0][:40]!r}; the choices are {','.join(known)}")
        return list(dict.fromkeys(items))  # each once, in the order given

    return parse


def existing_file(text: str) -> Path:
    """An argparse type: a file that is there (a folder is refused)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text[:200]}: {'a folder, not a file' if path.is_dir() else 'no such file'}")
    return path


def existing_dir(text: str) -> Path:
    """An argparse type: a folder that is there."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text[:200]}: {'a file, not a folder' if path.exists() else 'no such folder'}"
        )
    return path


def host_problem(host: str) -> str | None:
    """Why `host` is neither an IP address nor a host name (RFC 1123 labels), or None."""
    if not host:
        return "no host"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(HOST_LABEL.fullmatch(label) for label in labels):
        return f"{host[:100]!r} is not a host name or an IP address"
    if all(label.isdigit() for label in labels):  # 256.1.1.1 or 1.2.3: dotted numbers, not a valid address
        return f"{host[:100]!r} is not a valid IPv4 address"
    return None


def url_problem(text: str, schemes: Sequence[str] = ("http",), path: bool = False) -> str | None:
    """Why `text` is not a URL of one of `schemes` with a valid host and a port from 1 to 65535 (and,
    unless `path`, nothing after the host but '/'), or None."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:  # an unclosed [ of an IPv6 host, a port out of range or not a number
        return f"{text[:100]!r} is not a URL ({exc})"
    if parts.scheme not in schemes:
        return f"{text[:100]!r}: the URL must start with {' or '.join(s + '://' for s in schemes)}"
    problem = host_problem(parts.hostname or "")
    if problem:
        return f"{text[:100]!r}: {problem}"
    if port is not None and not 1 <= port <= 65535:
        return f"{text[:100]!r}: the port must be from 1 to 65535"
    if parts.username is not None or parts.query or parts.fragment or (not path and parts.path not in ("", "/")):
        return f"{text[:100]!r}: give only the scheme, host and port{' and path' if path else ''}"
    return None


def url(schemes: Sequence[str] = ("http",), path: bool = False) -> Callable[[str], str]:
    """An argparse type: a URL as url_problem accepts it, without a trailing '/'."""

    def parse(text: str) -> str:
        problem = url_problem(text, schemes, path)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return text.rstrip("/")

    return parse
