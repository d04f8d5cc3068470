"""Peak memory of one Runner, measured in a fresh process so runners do not share allocations.

    python -m engines.memprobe ROOT ENGINE_JSON INPUTS_NPZ
prints {"idle_rss_mb", "peak_rss_mb", "peak_memory_mb"}: peak_memory_mb is the peak resident size
while loading and running the batch in INPUTS_NPZ, less the process's size before loading (imports included).

The rest is the memory the pipeline plans and watches: what this machine lets a run use (MemAvailable,
the cgroup's limit, or OPTIMIZE_MEMORY_LIMIT_GB), the summed resident size of a process and all its
children sampled while it runs (TreePeak), and how a child that died is described: a child ended by
SIGKILL after its memory neared the limit, or when the cgroup's oom_kill counter rose, was killed for
memory ("killed for memory at 13.8 GB"), whatever it printed last.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
from pathlib import Path
from typing import Optional


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (a pipeline killed with SIGKILL must not
    leave a probe running); elsewhere, or if prctl is unavailable, a thread polls the parent instead."""
    import os
    import signal

    parent = os.getppid()
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):
        import threading
        import time

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent or parent == 1:  # the parent died before prctl took effect
        os._exit(1)


GB = 1e9
# The memory a run may use in all, in GB: tests and users on a shared machine set it to make the memory
# plan see less than the machine has (it never raises what the machine or its cgroup allows).
LIMIT_ENV = "OPTIMIZE_MEMORY_LIMIT_GB"
# A child ended by SIGKILL whose tree grew by at least this share of the memory free to it when it
# started was killed for memory (the rest of the machine's processes grow meanwhile too).
NEAR_LIMIT = 0.8


def _meminfo_bytes(key: str) -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_file(v2_name: str, v1_name: str) -> Optional[Path]:
    """This process's cgroup file (v2 unified hierarchy, else v1's memory controller)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and (Path("/sys/fs/cgroup") / path.lstrip("/") / v2_name).is_file():
            return Path("/sys/fs/cgroup") / path.lstrip("/") / v2_name
        if "memory" in controllers.split(","):
            for base in (Path("/sys/fs/cgroup/memory") / path.lstrip("/"), Path("/sys/fs/cgroup/memory")):
                if (base / v1_name).is_file():
                    return base / v1_name
    return None


def cgroup_limit_bytes() -> Optional[int]:
    """The cgroup's memory limit, None where there is none (v1 reports 'none' as a huge number)."""
    path = _cgroup_file("memory.max", "memory.limit_in_bytes")
    if path is None:
        return None
    text = path.read_text().strip()
    if text == "max" or not text.isdigit() or int(text) >= 1 << 60:
        return None
    return int(text)


def oom_kills() -> int:
    """The cgroup's count of processes the OOM killer ended (memory.events v2, memory.oom_control v1); 0
    where neither is readable, so a rise is evidence and no rise proves nothing."""
    path = _cgroup_file("memory.events", "memory.oom_control")
    if path is None:
        return 0
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return 0


def limit_bytes() -> int:
    """The memory a run may use in all: the machine's, the cgroup's limit, or OPTIMIZE_MEMORY_LIMIT_GB,
    whichever is least."""
    total = _meminfo_bytes("MemTotal") or 1 << 50
    limits = [total, cgroup_limit_bytes() or total]
    given = os.environ.get(LIMIT_ENV)
    if given:
        limits.append(int(float(given) * GB))
    return min(limits)


def free_bytes(held: int = 0) -> int:
    """The memory free to a run that holds `held` bytes already: MemAvailable (less what the cgroup
    or OPTIMIZE_MEMORY_LIMIT_GB leaves it), with what it holds counted as its own."""
    available = (_meminfo_bytes("MemAvailable") or limit_bytes()) + held
    return max(0, min(available, limit_bytes()) - held)


def tree_rss_bytes(pid: int) -> int:
    """The memory process `pid` and all its descendants hold (0 once it is gone): their summed
    proportional set size, so pages a forked child shares with its parent count once, or their
    resident size where PSS is not readable."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += _pss_or_rss(process)
        except psutil.Error:
            continue  # it ended between the listing and the reading
    return total


def _pss_or_rss(process) -> int:
    import psutil

    try:
        return process.memory_full_info().pss
    except (psutil.AccessDenied, AttributeError):
        return process.memory_info().rss


class TreePeak:
    """The peak summed resident size of a process tree, sampled by a thread every `every_s` seconds
    from start() (or entering `with`) until stop(); `marks` are named peaks a caller can restart."""

    def __init__(self, pid: Optional[int] = None, every_s: float = 0.25):
        self.pid = pid if pid is not None else os.getpid()
        self.every_s = every_s
        self.peak = 0
        self.first: Optional[int] = None  # the first sample: what the tree held when watching began
        self.marks: dict[str, int] = {}
        self._lock = threading.Lock()  # marks are set and read by the caller while the thread samples
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "TreePeak":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="memory-peak", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self) -> int:
        now = tree_rss_bytes(self.pid)
        with self._lock:
            if self.first is None:
                self.first = now
            self.peak = max(self.peak, now)
            for name in self.marks:
                self.marks[name] = max(self.marks[name], now)
        return now

    def mark(self, name: str) -> None:
        """Start a named peak from now (what the tree holds now, then the most it holds until read)."""
        now = tree_rss_bytes(self.pid)
        with self._lock:
            self.marks[name] = now

    def read(self, name: str) -> int:
        self.sample()
        with self._lock:
            return self.marks.pop(name, self.peak)

    def growth(self) -> int:
        """How much more than at its first sample the tree held at its peak."""
        return self.peak - (self.first or 0)

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak

    def __enter__(self) -> "TreePeak":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def killed_words(returncode: Optional[int], peak: "TreePeak", allowed: int, oom_kills_before: int) -> Optional[str]:
    """How a child that ended with `returncode` (negative: the signal) is described when a signal ended
    it: killed for memory when the cgroup's OOM counter rose, or when SIGKILL came after its tree grew
    by NEAR_LIMIT of the `allowed` bytes free to it when it started; else the signal. None when no
    signal ended it."""
    if returncode is None or returncode >= 0:
        return None
    at = f"at {peak.peak / GB:.1f} GB" if peak.peak else "(its memory was not sampled)"
    oom = oom_kills() > oom_kills_before
    if returncode == -signal.SIGKILL and (oom or peak.growth() >= NEAR_LIMIT * allowed):
        return f"killed for memory {at} ({allowed / GB:.1f} GB was free to it)"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"killed by {name} {at}"


def free_to_child() -> int:
    """What a child started now may use: what is free beside this process and its children."""
    return free_bytes(tree_rss_bytes(os.getpid()))


def run_watched(command: list[str], **popen) -> tuple[int, int, Optional[str]]:
    """`command` run to its end (Popen's keywords) with its tree's memory sampled: (return code, peak
    bytes, how it was killed or None)."""
    import subprocess

    allowed, before = free_to_child(), oom_kills()
    process = subprocess.Popen(command, **popen)
    with TreePeak(process.pid) as peak:
        returncode = process.wait()
    return returncode, peak.peak, killed_words(returncode, peak, allowed, before)


def main(argv: list[str]) -> None:
    die_with_parent()
    root, engine_json, inputs_path = Path(argv[0]), argv[1], argv[2]
    import importlib

    import numpy as np

    from engines import formats, load_engine

    engine = json.loads(engine_json)
    for module in formats.get(engine.get("format")).runtime_modules:  # before measuring the idle size
        importlib.import_module(module)

    idle = _rss_mb()
    runner = load_engine(root, engine, threads=int(engine.get("threads", 0)))
    with np.load(inputs_path) as inputs:
        runner({name: inputs[name] for name in runner.input_names})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(json.dumps({"idle_rss_mb": idle, "peak_rss_mb": peak, "peak_memory_mb": peak - idle}))


if __name__ == "__main__":
    main(sys.argv[1:])
