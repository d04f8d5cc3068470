"""The dynamic batcher on its own: a fake model that records the batches it is given."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from serve.encoder.batching import Batcher
from serve.errors import HTTPError


class Recorder:
    def __init__(self, delay_s: float = 0.0, gate: threading.Event | None = None):
        self.batches: list[list] = []
        self.delay_s = delay_s
        self.gate = gate

    def __call__(self, payloads: list) -> list:
        if self.gate:
            self.gate.wait(5)
        time.sleep(self.delay_s)
        self.batches.append(list(payloads))
        return [p * 10 for p in payloads]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_share_batches_and_get_their_own_results():
    async def scenario():
        model = Recorder(delay_s=0.02)
        batcher = Batcher(model, max_batch_size=8, max_queue_delay_s=0.005, max_queue=64)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(i, 1, 5) for i in range(32)))
        await batcher.stop()
        return model, results

    model, results = run(scenario())
    assert results == [i * 10 for i in range(32)]
    assert max(len(b) for b in model.batches) == 8
    assert len(model.batches) < 32  # batched, not one call per request
    assert sorted(p for b in model.batches for p in b) == list(range(32))


def test_batches_respect_rows_not_just_requests():
    async def scenario():
        model = Recorder(gate=threading.Event())
        batcher = Batcher(model, max_batch_size=4, max_queue_delay_s=0.0, max_queue=64)
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.submit(i, 3, 5)) for i in range(3)]
        await asyncio.sleep(0.05)
        model.gate.set()
        await asyncio.gather(*tasks)
        await batcher.stop()
        return model

    model = run(scenario())
    assert all(len(b) == 1 for b in model.batches)  # 3 + 3 rows > 4: never together


def test_a_lone_request_is_not_held_for_the_queue_delay():
    async def scenario():
        batcher = Batcher(Recorder(), max_batch_size=32, max_queue_delay_s=2.0, max_queue=8)
        batcher.start()
        started = time.perf_counter()
        await batcher.submit(1, 1, 5)
        elapsed = time.perf_counter() - started
        await batcher.stop()
        return elapsed

    assert run(scenario()) < 1.0  # far below the 2 s delay: nothing else was coming


def test_full_queue_refuses_with_429_and_retry_after():
    async def scenario():
        gate = threading.Event()
        batcher = Batcher(Recorder(gate=gate), max_batch_size=1, max_queue_delay_s=0, max_queue=2)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(0, 1, 5))
        await asyncio.sleep(0.05)  # the worker holds request 0; the queue is empty again
        queued = [asyncio.ensure_future(batcher.submit(i, 1, 5)) for i in (1, 2)]
        await asyncio.sleep(0)
        with pytest.raises(HTTPError) as refused:
            await batcher.submit(3, 1, 5)
        gate.set()
        done = await asyncio.gather(first, *queued)
        await batcher.stop()
        return refused.value, done

    error, done = run(scenario())
    assert error.status == 429 and error.headers["Retry-After"] == "1"
    assert done == [0, 10, 20]


def test_timeout_gives_504_and_the_expired_request_never_runs():
    async def scenario():
        gate = threading.Event()
        model = Recorder(gate=gate)
        batcher = Batcher(model, max_batch_size=1, max_queue_delay_s=0, max_queue=8)
        batcher.start()
        blocker = asyncio.ensure_future(batcher.submit(0, 1, 5))
        await asyncio.sleep(0.05)
        with pytest.raises(HTTPError) as late:
            await batcher.submit(1, 1, 0.1)
        gate.set()
        await blocker
        await batcher.stop()
        return late.value, model

    error, model = run(scenario())
    assert error.status == 504
    assert [p for b in model.batches for p in b] == [0]


def test_stop_drains_queued_requests_then_refuses_new_ones():
    async def scenario():
        gate = threading.Event()
        batcher = Batcher(Recorder(gate=gate), max_batch_size=2, max_queue_delay_s=0, max_queue=64)
        batcher.start()
        tasks = [asyncio.ensure_future(batcher.submit(i, 1, 5)) for i in range(10)]
        await asyncio.sleep(0.02)
        stopping = asyncio.ensure_future(batcher.stop())
        await asyncio.sleep(0.02)
        gate.set()
        await stopping
        results = await asyncio.gather(*tasks)
        with pytest.raises(HTTPError) as refused:
            await batcher.submit(99, 1, 1)
        return results, refused.value

    results, error = run(scenario())
    assert results == [i * 10 for i in range(10)]
    assert error.status == 503


def test_a_failing_batch_reports_to_every_caller():
    def broken(payloads):
        raise RuntimeError("boom")

    async def scenario():
        batcher = Batcher(broken, max_batch_size=4, max_queue_delay_s=0, max_queue=8)
        batcher.start()
        outcomes = await asyncio.gather(*(batcher.submit(i, 1, 5) for i in range(3)), return_exceptions=True)
        await batcher.stop()
        return outcomes

    assert all(isinstance(o, RuntimeError) for o in run(scenario()))
