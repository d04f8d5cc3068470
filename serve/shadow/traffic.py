"""Shadow traffic: every request the artifact answers is also sent to a candidate, off the response
path, and the two answers are compared with the gate's own measures.

The tap (ShadowTap, outermost ASGI middleware) copies a request's body and the artifact's answer as
they pass and, once the last byte went out, offers the pair to a bounded queue: when it is full the
pair is dropped and counted, never waited for. Worker threads send each pair's request to the
candidate over HTTP and compare. A candidate folder is served by a child `python -m serve` on
loopback at a lower CPU priority (nice 10): it shares no memory, thread or event loop with the
process answering users, so one that crashes, hangs or runs slow costs users nothing but what its
CPU share takes. The figures go to /metrics (serve_shadow_*) and to a report folder that
`python -m optimize.reports.compare` reads beside artifacts (serve/shadow/report.py).
"""

from __future__ import annotations

import base64
import collections
import http.client
import json
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from engines.similarity import cosine_rows

log = logging.getLogger("serve.shadow")

# The inference routes: what users ask the model. Health, metadata and /metrics are not shadowed.
SHADOWED = re.compile(
    r"^(/v2/models/[^/]+(/versions/[^/]+)?/infer|/v1/embeddings|/v1/completions|/v1/chat/completions|/predict)$"
)
# Set on every request the shadow sends. A request that carries it is answered but never shadowed
# again: a candidate that is this server, or a server shadowing this one back, would otherwise copy
# each copy on and on (20 requests became thousands of comparisons in seconds).
MARK = "x-optimize-shadow"
MARK_BYTES = MARK.encode()
FORWARDED = (b"content-type", b"content-encoding", b"authorization", b"inference-header-content-length")
CLASSIFIERS = ("text_classification", "token_classification")
GENERATES = "causal_lm"
COSINE_BUCKETS = (0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999, 1.0)
SHARE_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


@dataclass
class Exchange:
    """One answered request as the tap saw it."""

    path: str
    headers: dict[str, str]  # the request headers forwarded to the candidate
    body: bytes
    response_headers: dict[str, str]
    response: bytes
    artifact_s: float


# --- the measures (the gate's, as optimize/evaluate/fidelity.py computes them) ----------------------


def token_agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    """(share of positions where both have the same token, over the longer; the first position that
    differs, None when the two are identical)."""
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0, None
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return same / longest, first


# --- reading answers ---------------------------------------------------------------------------------


def tensors_of(headers: dict[str, str], body: bytes) -> dict[str, np.ndarray]:
    """A v2 infer answer's outputs, JSON or with the binary tensor extension."""
    length = headers.get("inference-header-content-length")
    head = json.loads(body[: int(length)] if length else body)
    blobs = memoryview(body)[int(length) :] if length else memoryview(b"")
    out, offset = {}, 0
    for tensor in head["outputs"]:
        dtype = np.dtype(V2_DTYPES[tensor["datatype"]])
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            values = np.frombuffer(blobs[offset : offset + size], dtype=dtype.newbyteorder("<"))
            offset += size
        else:
            values = np.asarray(tensor["data"], dtype=dtype)
        out[tensor["name"]] = values.reshape(tensor["shape"])
    return out


V2_DTYPES = {
    "FP32": "f4",
    "FP16": "f2",
    "FP64": "f8",
    "INT64": "i8",
    "INT32": "i4",
    "INT8": "i1",
    "UINT8": "u1",
    "BOOL": "?",
}


def embeddings_of(body: bytes) -> np.ndarray:
    rows = []
    for item in sorted(json.loads(body)["data"], key=lambda d: d["index"]):
        vector = item["embedding"]
        rows.append(np.frombuffer(base64.b64decode(vector), "<f4") if isinstance(vector, str) else np.asarray(vector))
    return np.stack(rows)


def labels_of(body: bytes) -> list[str]:
    """/predict: the top label of each text (labels come highest first)."""
    answer = json.loads(body)
    items = answer if answer and isinstance(answer[0], list) else [answer]
    return [str(item[0]["label"]) if item else "" for item in items]


def texts_of(headers: dict[str, str], body: bytes) -> list[str]:
    """The text of each choice of a completion or chat answer, whole or streamed (server-sent events)."""
    if "text/event-stream" in headers.get("content-type", ""):
        texts: dict[int, str] = collections.defaultdict(str)
        for line in body.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                texts[choice.get("index", 0)] += piece or ""
        return [texts[i] for i in sorted(texts)]
    choices = sorted(json.loads(body)["choices"], key=lambda c: c.get("index", 0))
    return [c["text"] if "text" in c else (c.get("message") or {}).get("content") or "" for c in choices]


# --- the candidate's side ------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP connection to the candidate, per worker thread, reopened after an error."""

    def __init__(self, url: str, timeout_s: float):
        parts = urlsplit(url)
        self.host, self.port, self.timeout_s = parts.hostname or "127.0.0.1", parts.port or 80, timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            self.conn.request("POST", path, body=body, headers=headers)
            response = self.conn.getresponse()
            data = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
        except BaseException:
            self.conn.close()
            self.conn = None
            raise


@dataclass
class Tally:
    """Running figures over every compared request (bounded: sums, extremes and recent latencies)."""

    rows: int = 0
    cosine_sum: float = 0.0
    cosine_min: float | None = None
    labels: int = 0
    labels_equal: int = 0
    generations: int = 0
    token_agreement_sum: float = 0.0
    exact: int = 0
    divergences: list[int] = field(default_factory=list)
    latency: dict[str, collections.deque] = field(
        default_factory=lambda: {side: collections.deque(maxlen=10000) for side in ("artifact", "candidate")}
    )
    outcomes: collections.Counter = field(default_factory=collections.Counter)


class Shadow:
    """The queue, the worker threads and the comparison; `offer` is all the response path calls."""

    def __init__(self, url: str, task: str, metrics, queue_size: int = 64, timeout_s: float = 30, workers: int = 2):
        from prometheus_client import Counter, Gauge, Histogram

        from serve.metrics import LATENCY_BUCKETS

        self.url, self.task, self.timeout_s = url, task, timeout_s
        self.queue: queue.Queue[Exchange | None] = queue.Queue(maxsize=queue_size)
        self.tally = Tally()
        self.lock = threading.Lock()
        self.ready = threading.Event()  # the candidate answered its readiness probe
        r = metrics.registry
        self.requests = Counter(
            "serve_shadow_requests",
            "Answered requests offered to the shadow candidate, by outcome (compared, failed, dropped, not_ready)",
            ["outcome"],
            registry=r,
        )
        self.cosine = Histogram(
            "serve_shadow_cosine",
            "Shadow: cosine of each candidate output row to the artifact's",
            buckets=COSINE_BUCKETS,
            registry=r,
        )
        self.agreement = Histogram(
            "serve_shadow_agreement",
            "Shadow: per request, labels (classifiers) or tokens by position (LMs) equal to the artifact's",
            buckets=SHARE_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "serve_shadow_latency_seconds",
            "Shadow: request latency on each side (artifact: what users waited)",
            ["side"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.depth = Gauge(
            "serve_shadow_queue_depth", "Shadow: answered requests waiting for the candidate", registry=r
        )
        self.depth.set_function(self.queue.qsize)
        self.threads = [threading.Thread(target=self.work, name=f"shadow-{i}", daemon=True) for i in range(workers)]
        for thread in self.threads:
            thread.start()

    # the response path: never blocks
    def offer(self, exchange: Exchange) -> None:
        if not self.ready.is_set():
            return self.count("not_ready")
        try:
            self.queue.put_nowait(exchange)
        except queue.Full:
            self.count("dropped")

    def count(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        with self.lock:
            self.tally.outcomes[outcome] += 1

    # the workers
    def work(self) -> None:
        connection = Connection(self.url, self.timeout_s)
        while (exchange := self.queue.get()) is not None:
            try:
                self.shadow(connection, exchange)
            except Exception as exc:  # a candidate's failure is a count, never an error of the server
                log.debug("shadow request failed: %s: %s", type(exc).__name__, exc)
                self.count("failed")

    def shadow(self, connection: Connection, exchange: Exchange) -> None:
        started = time.perf_counter()
        status, headers, body = connection.post(exchange.path, exchange.body, {**exchange.headers, MARK: "1"})
        candidate_s = time.perf_counter() - started
        if status != 200:
            raise RuntimeError(f"the candidate answered {status}")
        self.compare(connection, exchange, headers, body)
        self.latency.labels("artifact").observe(exchange.artifact_s)
        self.latency.labels("candidate").observe(candidate_s)
        with self.lock:
            self.tally.latency["artifact"].append(exchange.artifact_s)
            self.tally.latency["candidate"].append(candidate_s)
        self.count("compared")

    def compare(self, connection: Connection, exchange: Exchange, headers: dict[str, str], body: bytes) -> None:
        path = exchange.path
        if path.endswith("/infer"):
            mine, theirs = tensors_of(exchange.response_headers, exchange.response), tensors_of(headers, body)
            if self.task in CLASSIFIERS:
                return self.record_labels(*(list(t[next(iter(t))].argmax(-1).reshape(-1)) for t in (mine, theirs)))
            deciding = ["sentence_embedding"] if "sentence_embedding" in mine else list(mine)
            return self.record_cosine(np.concatenate([cosine_rows(mine[n], theirs[n]) for n in deciding]))
        if path == "/v1/embeddings":
            return self.record_cosine(cosine_rows(embeddings_of(exchange.response), embeddings_of(body)))
        if path == "/predict":
            return self.record_labels(labels_of(exchange.response), labels_of(body))
        mine_texts, their_texts = texts_of(exchange.response_headers, exchange.response), texts_of(headers, body)
        for a, b in zip(mine_texts, their_texts):
            self.record_tokens(self.tokens(connection, a), self.tokens(connection, b))

    def tokens(self, connection: Connection, text: str) -> list[int]:
        """The text's token ids by the candidate's tokenizer (its /tokenize route): both sides'
        texts are counted by one tokenizer, off the artifact's engine thread."""
        status, _, body = connection.post(
            "/tokenize", json.dumps({"content": text}).encode(), {"content-type": "application/json", MARK: "1"}
        )
        if status != 200:
            raise RuntimeError(f"the candidate's /tokenize answered {status}")
        return list(json.loads(body)["tokens"])

    def record_cosine(self, cosine: np.ndarray) -> None:
        cosine = np.clip(cosine, -1.0, 1.0)  # rounding takes identical rows a hair past 1
        for value in cosine:
            self.cosine.observe(float(value))
        with self.lock:
            t = self.tally
            t.rows += len(cosine)
            t.cosine_sum += float(cosine.sum())
            t.cosine_min = min(float(cosine.min()), t.cosine_min if t.cosine_min is not None else 1.0)

    def record_labels(self, mine: list, theirs: list) -> None:
        equal = sum(a == b for a, b in zip(mine, theirs))
        self.agreement.observe(equal / max(len(mine), 1))
        with self.lock:
            self.tally.labels += len(mine)
            self.tally.labels_equal += equal

    def record_tokens(self, mine: list[int], theirs: list[int]) -> None:
        share, first = token_agreement(mine, theirs)
        self.agreement.observe(share)
        with self.lock:
            t = self.tally
            t.generations += 1
            t.token_agreement_sum += share
            t.exact += first is None
            t.divergences.append(first if first is not None else len(mine))
            del t.divergences[:-10000]

    # the summary
    def summary(self) -> dict[str, Any]:
        with self.lock:
            t = self.tally
            figures: dict[str, Any] = {}
            if t.rows:
                figures.update(cosine_min=t.cosine_min, cosine_mean=t.cosine_sum / t.rows, rows=t.rows)
            if t.labels:
                figures.update(prediction_agreement=t.labels_equal / t.labels, labels=t.labels)
            if t.generations:
                figures.update(
                    token_agreement=t.token_agreement_sum / t.generations,
                    exact_match=t.exact / t.generations,
                    first_divergence_mean=float(np.mean(t.divergences)),
                    generations=t.generations,
                )
            latency = {side: percentiles(list(values)) for side, values in t.latency.items()}
            return {
                "task": self.task,
                "candidate": self.url,
                "figures": figures,
                "latency_ms": latency,
                "requests": dict(t.outcomes),
            }

    def close(self, timeout_s: float = 5) -> None:
        """Stop the workers: the ones waiting on a hung candidate are daemon threads, left behind."""
        for _ in self.threads:
            try:
                self.queue.put(None, timeout=0.1)
            except queue.Full:
                break
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p50, p95 = np.percentile(np.asarray(values) * 1e3, [50, 95])
    return {"p50": float(p50), "p95": float(p95), "n": len(values)}


# --- the tap -------------------------------------------------------------------------------------------


class ShadowTap:
    """ASGI middleware: copies what passes on the inference routes and offers each answered (200)
    request to the shadow once its response is complete. It adds no await of its own to the path.
    A request the shadow sent (it carries MARK) passes untouched: copies are never copied."""

    def __init__(self, app, shadow: Shadow):
        self.app, self.shadow = app, shadow

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not SHADOWED.match(scope["path"]):
            return await self.app(scope, receive, send)
        if any(name == MARK_BYTES for name, _ in scope["headers"]):
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        body: list[bytes] = []
        answer: list[bytes] = []
        start: dict = {}

        async def tap_receive():
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def tap_send(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                answer.append(message.get("body", b""))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and start.get("status") == 200:
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in FORWARDED}
                response_headers = {
                    k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start.get("headers", [])
                }
                elapsed = time.perf_counter() - started
                self.shadow.offer(
                    Exchange(scope["path"], headers, b"".join(body), response_headers, b"".join(answer), elapsed)
                )

        await self.app(scope, tap_receive, tap_send)
