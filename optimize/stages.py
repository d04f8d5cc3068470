"""Each stage's time and peak memory as the run goes: the run's own process and all its children
(engines/memprobe.TreePeak), kept for the manifest and said on the console where the time went."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Optional

log = logging.getLogger(__name__)
GB = 1e9
# The first words of the stages that score the trusted gate's measures (token fidelity, standard tasks):
# their seconds are summed on the console, what those measures add to a run.
EVALUATION = "evaluation: "


class StageLog:
    """`with log.stage(name):` records the stage's seconds and its peak; stages may nest (the race's
    builds inside the engine stage), each with its own peak."""

    def __init__(self, every_s: float = 1.0):  # a sample costs ~10 ms of CPU (it lists /proc)
        from engines.memprobe import TreePeak

        self.peak = TreePeak(every_s=every_s).start()
        self.rows: list[dict] = []
        self.started = time.monotonic()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        mark = f"{name}#{len(self.rows)}-{time.monotonic()}"
        self.peak.mark(mark)
        start = time.monotonic()
        try:
            yield
        finally:
            seconds = time.monotonic() - start
            peak = self.peak.read(mark) / GB
            self.rows.append({"stage": name, "seconds": round(seconds, 1), "peak_gb": peak, "start": start})
            self.rows.sort(key=lambda row: row["start"])  # an enclosing stage before the stages inside it

    def close(self) -> None:
        self.peak.stop()

    def record(self) -> list[dict]:
        """The stages finished so far, as the manifest keeps them."""
        return [
            {**{k: v for k, v in row.items() if k != "start"}, "peak_gb": round(row["peak_gb"], 2)} for row in self.rows
        ]

    def evaluation_seconds(self) -> dict[str, float]:
        """Seconds spent on each of the trusted gate's measures (stages named EVALUATION...), summed by name."""
        spent: dict[str, float] = {}
        for row in self.rows:
            if row["stage"].startswith(EVALUATION):
                name = row["stage"][len(EVALUATION) :]
                spent[name] = spent.get(name, 0.0) + row["seconds"]
        return spent

    def evaluation_line(self) -> str:
        spent = self.evaluation_seconds()
        parts = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in spent.items())
        return f"the fidelity and task measures took {sum(spent.values()):.0f} s ({parts})"

    def lines(self) -> list[str]:
        """Where the time went, stage by stage (nested stages after their enclosing one)."""
        total = max(time.monotonic() - self.started, 1e-9)
        out = [f"where the time went ({total:.0f} s, peak {self.peak.peak / GB:.1f} GB of the run and its children):"]
        if self.evaluation_seconds():
            out[0] += f" {self.evaluation_line()}"
        for row in self.rows:
            share = 100 * row["seconds"] / total
            out.append(f"  {row['stage']}: {row['seconds']:.0f} s ({share:.0f}%), peak {row['peak_gb']:.1f} GB")
        return out


_current: Optional[StageLog] = None


@contextlib.contextmanager
def running(every_s: float = 1.0) -> Iterator[StageLog]:
    """A StageLog for the run, the one `stage` records into until it ends."""
    global _current
    previous, _current = _current, StageLog(every_s)
    try:
        yield _current
    finally:
        _current.close()
        # The console gets the headline (total time and peak); each stage's line goes to the run's log
        # (the artifact's run.log, the console with -v) and its figures to the manifest's resources.
        for number, line in enumerate(_current.lines()):
            log.log(logging.INFO if number == 0 else logging.DEBUG, "%s", line)
        _current = previous


def stage(name: str):
    """A stage of the run being recorded (a no-op outside `running`, as in a method called alone)."""
    return _current.stage(name) if _current is not None else contextlib.nullcontext()
