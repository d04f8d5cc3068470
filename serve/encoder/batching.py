"""Dynamic batching: requests that arrive together run as one call of the Runner.

One worker task owns the model. It takes the oldest queued request and then keeps taking more
until the batch holds `max_batch_size` rows or `max_queue_delay` has passed. It waits for more
only when there is evidence of concurrent load (the previous batch held more than one request,
or requests are being parsed right now): a lone client is never made to wait for company that
is not coming, so batching costs nothing at concurrency 1.

The queue is bounded: a request that finds it full is refused at once (429 with Retry-After)
instead of joining an unbounded backlog. Each request carries a deadline; one that expires while
queued is dropped before it reaches the model; so are the queued pieces of a request that is
refused, times out or is abandoned by its client (submit_many).

The model runs in one dedicated thread: ONNX Runtime releases the GIL while it computes, so the
event loop keeps accepting and parsing requests while a batch runs. The hand-offs are kept to the
minimum a request needs (this is the latency a lone client pays): the caller awaits its own future
(the timeout is a timer on the loop, not a wait_for/shield pair of extra tasks and futures), and
the runner thread delivers each result straight to the callers' futures with one thread-safe call
back into the loop, which also wakes the worker for the next batch.
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from serve.errors import busy, timed_out, unavailable


class BatchItem(Protocol):
    """What a request becomes before it is batched (serve.encoder.model.EncoderBatchItem,
    serve.encoder.tensors.TensorBatchItem): its rows, and how it is cut into batch-sized pieces."""

    @property
    def rows(self) -> int: ...

    def split(self, size: int) -> list[Any]: ...


class BatchModel(Protocol):
    """A model that answers batches of items (serve.encoder.model.EncoderModel and its classifiers,
    serve.encoder.tensors.TensorModel): the Batcher runs its run_batch, the KServe routes read the rest."""

    task: str
    output_names: list[str]

    def from_tensors(self, inputs: dict[str, np.ndarray]) -> Any:
        """A request's tensors checked and made a BatchItem."""
        ...

    def run_batch(self, items: list) -> list[dict[str, np.ndarray]]: ...

    def tensor_metadata(self) -> tuple[list[dict], list[dict]]: ...


@dataclass
class Pending:
    payload: Any
    rows: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


class Batcher:
    def __init__(
        self,
        run_batch: Callable[[list], list],
        max_batch_size: int,
        max_queue_delay_s: float,
        max_queue: int,
        metrics=None,
        name: str = "model",
    ):
        self.run_batch = run_batch  # list of payloads -> list of results, same order
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue = max_queue
        self.metrics = metrics
        self.queue: collections.deque[Pending] = collections.deque()
        self.arriving = 0  # requests accepted and being parsed: more work is on its way
        self.last_batch_requests = 0
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-runner")
        self.wakeup = asyncio.Event()  # replaced by start(), inside the serving loop
        self.worker: asyncio.Task | None = None
        self.closing = False

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.wakeup = asyncio.Event()
        self.worker = asyncio.get_running_loop().create_task(self.work())

    async def stop(self) -> None:
        """Finish every queued request, then stop the worker (used when draining on SIGTERM)."""
        self.closing = True
        if self.worker:
            self.wakeup.set()
            await self.worker
        self.executor.shutdown(wait=True)

    # --- submitting ------------------------------------------------------------------------------

    async def submit(self, payload, rows: int, timeout_s: float):
        """Queue one request of `rows` rows and wait for its result (429 if full, 504 on timeout)."""
        return (await self.submit_many([(payload, rows)], timeout_s))[0]

    async def submit_many(self, pieces: list[tuple[Any, int]], timeout_s: float) -> list:
        """Queue a request's pieces [(payload, rows)] together and wait for all their results.

        All or nothing: a request that does not fit in the queue is refused (429) before any piece is
        queued. One deadline covers every piece; when the request fails, times out or its caller goes
        away (a client disconnect cancels this coroutine), its pieces still queued are removed at once,
        so none reaches the model and none holds a place another request could use."""
        if self.worker is None or self.closing:
            raise unavailable("the model is not accepting requests")
        if len(self.queue) + len(pieces) > self.max_queue:
            raise busy()
        loop = asyncio.get_running_loop()
        pending = [Pending(payload, rows, loop.create_future()) for payload, rows in pieces]
        self.queue.extend(pending)
        self.observe_queue()
        self.wakeup.set()
        timer = loop.call_later(timeout_s, self.expire_all, pending, timeout_s)
        try:
            results = []
            for p in pending:  # the first failure ends the wait (and drops the rest below)
                results.append(await p.future)
            return results
        finally:
            timer.cancel()
            self.drop(pending)

    def drop(self, pending: list[Pending]) -> None:
        """Take a request's pieces out of the queue, cancelling those not finished."""
        for p in pending:
            if not p.future.done():
                p.future.cancel()
            elif not p.future.cancelled():
                p.future.exception()  # retrieved: asyncio does not log it as never retrieved
        gone = {id(p) for p in pending}
        if any(id(p) in gone for p in self.queue):
            self.queue = collections.deque(p for p in self.queue if id(p) not in gone)
            self.observe_queue()

    def expire_all(self, pending: list[Pending], timeout_s: float) -> None:
        """The request's deadline passed: its caller gets 504; its pieces still queued leave the queue."""
        for p in pending:
            if not p.future.done():
                p.future.set_exception(timed_out(timeout_s))
        self.drop(pending)

    # --- the worker ------------------------------------------------------------------------------

    async def work(self) -> None:
        while True:
            if not self.queue:
                if self.closing:
                    return
                self.wakeup.clear()
                await self.wakeup.wait()
                continue
            batch = await self.collect()
            if batch:
                await self.run(batch)

    async def collect(self) -> list[Pending]:
        batch: list[Pending] = []
        rows = 0
        deadline = time.perf_counter() + self.max_queue_delay_s
        while rows < self.max_batch_size:
            if self.queue:
                head = self.queue[0]
                if head.future.done():  # timed out while queued
                    self.queue.popleft()
                    continue
                if batch and rows + head.rows > self.max_batch_size:
                    break
                batch.append(self.queue.popleft())
                rows += head.rows
                continue
            remaining = deadline - time.perf_counter()
            if not batch or remaining <= 0 or not self.expect_more():
                break
            self.wakeup.clear()
            try:
                await asyncio.wait_for(self.wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                break
        self.observe_queue()
        return batch

    def expect_more(self) -> bool:
        return not self.closing and (self.arriving > 0 or self.last_batch_requests > 1)

    async def run(self, batch: list[Pending]) -> None:
        self.last_batch_requests = len(batch)
        if self.metrics:
            self.metrics.batch_size.observe(sum(p.rows for p in batch))
            for p in batch:
                self.metrics.queue_wait.observe(time.perf_counter() - p.enqueued)
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def deliver(results, error):  # on the loop, called once from the runner thread
            for i, p in enumerate(batch):
                if not p.future.done():
                    if error is None:
                        p.future.set_result(results[i])
                    else:  # the whole batch failed: every caller learns why
                        p.future.set_exception(error)
            if not finished.done():  # the worker may have been cancelled meanwhile
                finished.set_result(None)

        def call():  # in the runner thread
            try:
                results, error = self.run_batch([p.payload for p in batch]), None
            except Exception as exc:
                results, error = None, exc
            try:
                loop.call_soon_threadsafe(deliver, results, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        self.executor.submit(call)
        await finished

    def observe_queue(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self.queue))


def expire(future: asyncio.Future, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(timed_out(timeout_s))
