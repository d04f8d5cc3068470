"""`--record PATH`: a benchmark's headline figure written as a row of docs/figures.md's table.

The record (optimize/docs/figures.py's SCHEMA) carries what was measured, the figure, its ratio against
the baseline or peer, and the date, CPU, load and command of this run, so running a row's command again
with `--record docs/figures/NAME.json` brings that row up to date (then `python -m optimize.docs.figures`
rewrites the table).
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "also write this run's headline figure as a record of docs/figures.md's table (docs/figures/NAME.json)"


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", type=Path, default=None, help=HELP)


def write(
    args: argparse.Namespace, module: str, argv: list[str] | None, *, measure: str, figure: str, ratio: str | None
) -> None:
    """Write the record where `--record` asked (nothing when it was not given): its measure, figure and
    ratio as given, the rest this machine's now and the command line that ran."""
    if args.record is None:
        return
    from optimize.docs.figures import write_record

    write_record(args.record, measure=measure, figure=figure, ratio=ratio, module=module, argv=argv)
