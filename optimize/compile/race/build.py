"""Building the candidates: one checked ONNX export they all start from, then each candidate's
registered methods (or its copy from the cache), each in a process of its own that is ended when the
candidate's build budget (or what is left of the race's) runs out, so a build that overruns or a
search that does not converge costs its budget and no more; the race goes on with the others."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from engines.onnxruntime.export import copy_onnx
from optimize.compile.race import cache
from optimize.compile.race.budget import Budget
from optimize.compile.race.entry import Entry
from optimize.errors import RecipeError

log = logging.getLogger(__name__)


def export_once(model, ctx) -> tuple[Any, Optional[dict]]:
    """One checked ONNX export (fused for ONNX Runtime) that every candidate starts from, and its
    record (None for a model that came as ONNX)."""
    from optimize.compile.onnx import OnnxExportConfig, onnx_engine

    if model.kind == "onnx":
        return model, None
    exported = onnx_engine(model, OnnxExportConfig(), ctx)
    folder = ctx.scratch / "race" / "export"
    folder.mkdir(parents=True, exist_ok=True)
    copied = exported.with_onnx(copy_onnx(exported.onnx_path, folder))
    return dataclasses.replace(copied, record={}), exported.record


POLL_S = 1.0  # how often the race looks at a build in progress (and redraws its progress line)


def build_all(
    entries: list[Entry], exported, ctx, key_base: Optional[str], budget: Budget, line: Optional["ProgressLine"] = None
) -> None:
    """Build every candidate not refused, each within its budget and what is left of the race's, with
    one progress line on the console saying which is building and for how long against its budget."""
    ctx.calibration()  # read here, not first in a build's process, so the run knows it was read
    if any(e.spec.quantize for e in entries if not e.refused):
        from optimize.evaluate.kernels import int8_gemm_speedup

        int8_gemm_speedup(ctx.threads)  # measured once here (cached) for every quantize record, not per build
    from optimize.evaluate.idle import baseline_idles

    baseline_idles(ctx.baseline, "the candidates build")  # each builder holds its own copy, or reads the pages itself
    line = line or ProgressLine()
    for number, entry in enumerate(entries, 1):
        if entry.refused:
            continue
        limit_s, whose = budget.limit_for(entry)
        if limit_s <= 0:
            entry.outcome = f"not built: {budget.describe()} was spent before it started"
            entry.budget_cut = True
            continue
        head = f"race: building {entry.name} ({number}/{len(entries)})"
        build(entry, exported, ctx, key_base, limit_s, whose, _ticker(line, head, limit_s))
        budget.note(entry)
    line.close()


def _ticker(line: "ProgressLine", head: str, limit_s: float) -> Callable[[float], None]:
    return lambda seconds: line.show(f"{head}: {seconds:.0f} s of {limit_s:.0f} s")


def build(
    entry: Entry,
    exported,
    ctx,
    key_base: Optional[str],
    limit_s: float = float("inf"),
    whose: str = "",
    tick: Callable[[float], None] = lambda seconds: None,
) -> None:
    """Build one candidate from the export (or take it from the cache) within `limit_s` seconds; a
    candidate that cannot be built here (no OpenVINO, no bf16, a method that does not apply) is
    recorded, not fatal, and so is one cut at its budget (`whose`: the budget, as the outcome names it)."""
    if key_base:  # a cached candidate is used only when it verifies; why not is reported
        entry.model, entry.records, why = cache.load_cached(key_base, entry.spec, exported)
        if entry.model is not None:
            entry.cached = True
            return
        entry.cache_rebuilt = "" if why == "not cached" else why
    where = cache.folder(key_base, entry.spec) if key_base else ctx.scratch / "race" / entry.name
    key = cache.key_of(key_base, entry.spec) if key_base else None
    start = time.monotonic()
    reply = run_bounded(lambda: _build_and_save(entry.spec, exported, ctx, where, key, limit_s), limit_s, tick)
    entry.build_s = time.monotonic() - start
    entry.build_peak_gb = reply.get("peak", 0) / 1e9
    if reply.get("cut"):
        _discard_partial(where, key, reply.get("pid"))
        entry.budget_cut = True
        entry.outcome = f"cut: over {whose} at {entry.build_s:.0f} s"
        log.warning("race: %s %s", entry.name, entry.outcome)
    elif "not_built" in reply:
        entry.outcome = f"not built: {reply['not_built']}"
        log.info("race: %s not built: %s", entry.name, reply["not_built"])
    elif "failed" in reply:
        _discard_partial(where, key, reply.get("pid"))
        entry.outcome = f"not built: {reply['failed']}"
        log.warning("race: %s failed to build: %s", entry.name, reply.get("trace") or reply["failed"])
    else:
        saved = json.loads((where / "candidate.json").read_text())
        entry.model = cache._model_from(where, saved, exported)
        entry.records = saved["records"]


def _build_and_save(spec, exported, ctx, where: Path, key: Optional[str], limit_s: float) -> dict:
    """In the build's own process: the candidate's methods, then its files into `where` (staged and
    sealed when it is the cache). Returns the reply the race reads."""
    from optimize import deadline, registry

    deadline.set_window(limit_s)
    records: dict = {}  # {stage: record} of this candidate's methods
    methods = [("engine", spec.engine, spec.engine_params)]
    if spec.quantize:
        methods.append(("quantize", spec.quantize, spec.quantize_params))
    built = exported
    try:
        for stage, name, params in methods:
            method = registry.get(stage, name)
            built = method.fn(built, registry.build_config(method, dict(params)), ctx).file_into(records, stage)
    except RecipeError as exc:
        return {"not_built": str(exc)}
    cache.save(built, records, where, key)
    return {"built": str(where)}


def run_bounded(work: Callable[[], dict], limit_s: float, tick: Callable[[float], None]) -> dict:
    """`work()` in a forked process of its own session, ended (with anything it started) when
    `limit_s` runs out: its reply, or {"cut": True, "pid": ...}; an exception in it is
    {"failed": "Type: message", "trace": ...}, a process that died is {"failed": "... exit code N"},
    or, ended by the kernel for memory, {"failed": "killed for memory at 13.8 GB ..."}. Every reply
    has "peak": the most its process and what it started held (bytes, sampled)."""
    import multiprocessing
    import warnings

    from engines import memprobe

    allowed, oom_before = memprobe.free_to_child(), memprobe.oom_kills()
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    with warnings.catch_warnings():  # fork beside the runtimes' thread pools: the child uses its own
        warnings.simplefilter("ignore", DeprecationWarning)
        process = multiprocessing.get_context("fork").Process(target=_child, args=(work, send), daemon=False)
        process.start()
    send.close()
    peak = memprobe.TreePeak(process.pid).start()
    start = time.monotonic()
    tick(0.0)

    def ended() -> dict:
        process.join()
        peak.stop()
        killed = memprobe.killed_words(process.exitcode, peak, allowed, oom_before)
        return {"failed": killed or f"its build process ended with exit code {process.exitcode}", "pid": process.pid}

    try:
        while not receive.poll(POLL_S):
            elapsed = time.monotonic() - start
            tick(elapsed)
            if not process.is_alive() and not receive.poll(0):
                return {**ended(), "peak": peak.peak}
            if elapsed >= limit_s:
                _end(process)
                return {"cut": True, "pid": process.pid, "peak": peak.stop()}
        try:
            reply = receive.recv()
        except EOFError:
            return {**ended(), "peak": peak.peak}
        process.join()
        peak.stop()
        if reply.get("memory_error"):  # an allocation refused (a ulimit, no overcommit): out of memory too
            reply["failed"] = f"ran out of memory at {peak.peak / memprobe.GB:.1f} GB ({reply['failed']})"
        return {**reply, "pid": process.pid, "peak": peak.peak}
    except BaseException:  # interrupted: the build goes with the race
        _end(process)
        raise
    finally:
        peak.stop()
        receive.close()


def _child(work: Callable[[], dict], send) -> None:
    os.setsid()  # its own session: ending it ends what it started too, and ^C reaches the race only
    try:
        reply = work()
    except Exception as exc:
        reply = {"failed": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        reply["memory_error"] = isinstance(exc, MemoryError)
    send.send(reply)
    send.close()


def _end(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    process.join()


def _discard_partial(where: Path, key: Optional[str], pid: Optional[int]) -> None:
    """What a build ended midway left: its scratch folder, or its staging folder beside the cache
    entry (cache_store.staging names it by the process); a sealed entry is only ever renamed into place."""
    if key is None:
        shutil.rmtree(where, ignore_errors=True)
        return
    for staged in where.parent.glob(f".{where.name}.{pid}.*.tmp"):
        shutil.rmtree(staged, ignore_errors=True)


class ProgressLine:
    """One line on the console that says where a long build is: redrawn in place on a terminal; in a
    log (not a terminal), written when a build starts and then once a minute, never a flood."""

    LOG_EVERY_S = 60.0

    def __init__(self, stream: Optional[TextIO] = None, tty: Optional[bool] = None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.drawn = False
        self.head = ""
        self.logged_at = -float("inf")

    def show(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text)
            self.drawn = True
        else:
            now = time.monotonic()
            head = text.rsplit(":", 1)[0]
            if head == self.head and now - self.logged_at < self.LOG_EVERY_S:
                return
            self.head, self.logged_at = head, now
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.drawn = False
