"""Peak memory of one Runner, measured in a fresh process so runners do not share allocations.

    python -m engines.memprobe ROOT ENGINE_JSON INPUTS_NPZ
prints {"idle_rss_mb", "peak_rss_mb", "peak_memory_mb"}: peak_memory_mb is the peak resident size
while loading and running the batch in INPUTS_NPZ, less the process's size before loading (imports included).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path


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
