"""The latency harness: same batches for every runner, blocks that start with an untimed call."""

from optimize.evaluate.benchmark import measure


class Recorder:
    """A runner that logs which batch it was called with, in a log shared by all runners."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __call__(self, batch):
        self.log.append((self.name, batch["i"]))


def test_runners_take_turns_in_blocks_on_the_same_batches():
    log = []
    batches = [{"i": i} for i in range(4)]
    stats = measure({"a": Recorder("a", log), "b": Recorder("b", log)}, batches, 1, warmup=1, repeats=6, block=3)
    timed = log[2:]  # after one warm-up call each
    # Block 1: a settles then runs 0,1,2; b the same; block 2 in reversed order, batches 3,0,1.
    assert timed[:8] == [("a", 0), ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 0), ("b", 1), ("b", 2)]
    assert timed[8:] == [("b", 3), ("b", 3), ("b", 0), ("b", 1), ("a", 3), ("a", 3), ("a", 0), ("a", 1)]
    assert stats["a"]["samples"] == stats["b"]["samples"] == 6


def test_repeats_shrink_to_the_time_budget_but_not_below_the_minimum():
    log = []
    stats = measure({"a": Recorder("a", log)}, [{"i": 0}], 1, warmup=1, repeats=1000, budget_s=0.0, min_repeats=5)
    assert stats["a"]["samples"] == 5


def test_cpu_time_of_a_child_process_counts_as_this_runs_own():
    """A worker timing a candidate is a child: its CPU time must not read as another process's."""
    import subprocess
    import sys

    import psutil

    from optimize.evaluate.benchmark import _own_cpu_seconds

    me = psutil.Process()
    burn = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\nprint(1, flush=True)\n"
    before = _own_cpu_seconds(me)
    child = subprocess.Popen([sys.executable, "-c", burn + "input()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"1"  # burned, still running
        assert _own_cpu_seconds(me) - before >= 0.35  # 0.4 s burned; the clock ticks in 10 ms
    finally:
        child.communicate(b"\n")
    assert _own_cpu_seconds(me) - before >= 0.35  # and once waited for


def test_a_busy_point_is_timed_again_only_while_another_run_fits_before_the_deadline():
    """The race's timing budget: a point timed on a busy machine wants up to two more runs; a deadline
    that leaves no room for one as long as the last keeps the first and says the retime was cut."""
    import time

    from optimize.evaluate.benchmark import MAX_RETIMES, quietest

    calls = []

    def busy_run():
        calls.append(1)
        time.sleep(0.2)
        return {"other_cpu_share": 0.5}

    cut = quietest(busy_run, until=time.monotonic() + 0.3)
    assert len(calls) == 1 and cut == {"other_cpu_share": 0.5, "retimes": 0, "retime_cut": True}
    calls.clear()
    roomy = quietest(busy_run, until=time.monotonic() + 60)
    assert len(calls) == 1 + MAX_RETIMES and roomy == {"other_cpu_share": 0.5, "retimes": MAX_RETIMES}
