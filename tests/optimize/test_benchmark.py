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
