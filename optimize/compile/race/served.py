"""Timing LM candidates as they are served: each candidate that passes accuracy is put in a minimal
artifact of its own, `python -m serve` is started on it on loopback (the served gate's server and load
driver, optimize/evaluate/served.py), and closed-loop streaming clients drive every request shape of
the workload at every concurrency level. A cell (shape, level) gives aggregate output tokens/s, TTFT
p95 and the mean time a request took (clients x wall / requests: a closed loop's latency).

Successive halving keeps this affordable: a first short round times every passing candidate with few
requests; one whose served cost is CUT_RATIO times the leader's or more is cut (its round-one figures
stay in the report, with why) and only the rest are timed again with more requests, as many as the
first round's pace fits in SECOND_ROUND_CELL_BUDGET_S a cell (a cell already that long keeps its
first-round figures).

An engine whose format does not batch (its row in engines/formats.py) is served one generation at a
time, first come first served: N clients in a closed loop each wait for the N requests in the queue,
so its cell at N clients is N / n times its cell at the fewest clients n, and that is what it gets
(marked `derived`) instead of being driven. Driving it would add nothing but minutes: at 1B parameters
sixteen 1,024-token requests one after another were most of a native candidate's 10-minute round.
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path
from typing import Any

from serve.config import GENERATION_TIMEOUT_S

log = logging.getLogger(__name__)

# Clearly behind after the first round: on a shared 2-core machine one served run moves by 10-20%, and
# candidates this far apart did not change places when timed again.
CUT_RATIO = 1.5
# Seconds a cell may take in the second round, judged by the first round's pace: a cell that would run
# longer gets fewer requests, and one whose first round already took that long keeps its figures (it
# would only be timed again with as few requests). SmolLM2's cells take seconds; at 1B parameters
# sixteen 1,024-token clients took 165 s in round one alone, and round two asked twice as many.
SECOND_ROUND_CELL_BUDGET_S = 60.0


def requests_per_client(clients: int, round_no: int) -> int:
    """Requests each client sends: in the first round two at one client and one at many (sixteen
    clients already give sixteen samples), in the second eight at one client and two at many."""
    return max(1, 2 // clients) if round_no == 1 else max(2, 8 // clients)


def second_round_requests(first: dict, clients: int) -> int | None:
    """Requests each client sends in the second round: requests_per_client's, fewer where the first
    round's pace says the cell would take more than SECOND_ROUND_CELL_BUDGET_S, or None (the cell is
    not driven again, its first-round figures stand) where that leaves no more than the first round
    sent. A cell that failed in the first round is driven again as asked."""
    wanted = requests_per_client(clients, 2)
    sent = (first.get("requests") or 0) // clients
    if first.get("request_ms") is None or not sent or not first.get("wall_s"):
        return wanted
    per_request_s = first["wall_s"] / sent  # the cell's wall for one request from every client
    affordable = max(1, int(SECOND_ROUND_CELL_BUDGET_S // per_request_s))
    count = min(wanted, affordable)
    return count if count > sent else None


def time_served(entries: list, ctx, workload) -> dict:
    """Fill `served` (by shape, then level) in each entry's metrics, in rounds; returns the halving record:
    {"rounds": [[names timed], ...], "cut": {name: why}}."""
    from optimize.evaluate.generation import Tokens, shape_prompts

    tokens, items = Tokens(ctx), ctx.evaluation_data().items
    prompts = {r.key: shape_prompts(tokens, items, r) for r in workload.requests}
    record: dict[str, Any] = {"rounds": [], "cut": {}, "cut_ratio": CUT_RATIO}
    alive = list(entries)
    for round_no in (1, 2):
        record["rounds"].append([e.name for e in alive])
        for entry in alive:
            entry.metrics["served"] = _serve_cells(entry, ctx, workload, prompts, round_no)
            entry.metrics["served_round"] = round_no
        costs = served_costs(alive, workload)
        record.setdefault("costs", []).append({name: round(cost, 3) for name, cost in costs.items()})
        if round_no == 2 or len(alive) < 2:
            break
        leader = min(costs.values())
        for entry in alive:
            if costs[entry.name] >= CUT_RATIO * leader:
                why = cut_reason(entry, workload, costs[entry.name] / leader)
                record["cut"][entry.name] = why
                entry.served_cut, entry.cost = why, costs[entry.name]  # its round-one cost stays in the report
                log.info("race: %s cut: %s", entry.name, why)
        alive = [e for e in alive if e.name not in record["cut"]]
        if len(alive) < 2:
            break
    return record


def cut_reason(entry, workload, ratio: float) -> str:
    """Why the first round cut it: how far behind the leader, or, where a request failed (its cost
    is then infinite), where and with what error."""
    failure = load_failure(entry, workload)
    if failure is not None:
        return f"its served load failed: {failure}"
    return f"{ratio:.2f}x the leader's served cost after the first round"


def load_failure(entry, workload) -> str | None:
    """The first cell (shape, then level) where a served request failed: the shape, the level, how
    many failed and their errors (the load keeps up to three distinct ones); None where none failed."""
    for shape in workload.requests:
        for level in workload.concurrency:
            cell = entry.metrics["served"][shape.key][level.key]
            if cell.get("request_ms") is None:
                errors = cell.get("errors") or ["no request answered"]
                if not cell.get("requests"):
                    return f"the server did not start: {errors[0]}"
                return (
                    f"{cell.get('failed')}/{cell.get('requests')} requests failed at {level.clients} "
                    f"client(s), shape {shape.key}: {' | '.join(errors)}"
                )
    return None


def served_costs(entries: list, workload) -> dict[str, float]:
    """Each entry's served cost: at every level the weighted request time over the shapes, over the best
    entry's at that level (so a level's larger times do not outweigh the others), weighted over levels."""
    per_level = {e.name: {c.key: level_ms(e, workload, c.key) for c in workload.concurrency} for e in entries}
    best = {c.key: min(per_level[e.name][c.key] for e in entries) for c in workload.concurrency}

    def ratio(mine: float, best: float) -> float:  # a level where every request failed counts alike for all
        return 1.0 if mine == best else mine / best

    return {
        e.name: sum(c.weight * ratio(per_level[e.name][c.key], best[c.key]) for c in workload.concurrency)
        for e in entries
    }


def level_ms(entry, workload, level: str) -> float:
    """The entry's weighted served request time at `level` clients (inf where a request failed)."""
    total = 0.0
    for shape in workload.requests:
        cell = entry.metrics["served"][shape.key][level]
        total += shape.weight * (cell["request_ms"] if cell.get("request_ms") is not None else float("inf"))
    return total


def driven_levels(entry, workload) -> list:
    """The levels the candidate's server is driven at: all of them, or for an engine that does not
    batch only the fewest clients (the others are derived from it)."""
    from optimize.compile.race.cells import batching

    if batching(entry) == "none":
        return [min(workload.concurrency, key=lambda c: c.clients)]
    return list(workload.concurrency)


def derived_cell(measured: dict, measured_clients: int, clients: int) -> dict:
    """A one-at-a-time server's cell at `clients`, from its cell at `measured_clients`: the request
    time scales with the queue (clients / measured_clients); throughput and the gap between tokens do
    not change; a first token waits for the requests ahead of it, from none to all the others, so a
    TTFT percentile q adds q of the extra queue. Checked against a driven cell at Llama-3.2-1B's shape
    (Q4_K_M, native kernels, 64 + 64 tokens, 2-core Zen 4): 16 clients measured 35.1 s a request,
    derived 36.3 s; TTFT p95 measured 31.3 s."""
    cell = dict(measured, derived=f"{clients} clients from {measured_clients}: one sequence at a time")
    if measured.get("request_ms") is None:  # a failure is carried as it was measured
        return cell
    one_request = measured["request_ms"] / measured_clients  # its own time, the queue's step
    cell["request_ms"] = round(clients * one_request, 1)
    for key, q in (("ttft_p50_ms", 0.5), ("ttft_p95_ms", 0.95)):
        if measured.get(key) is not None:
            cell[key] = round(measured[key] + q * (clients - measured_clients) * one_request, 1)
    return cell


def _serve_cells(entry, ctx, workload, prompts: dict, round_no: int) -> dict:
    """The entry's cells in this round: each shape at each driven level (driven_levels), those the
    second round's budget leaves alone kept from the first round, the others derived."""
    driven = driven_levels(entry, workload)  # decided before a server starts: nothing may raise between
    first = entry.metrics.get("served") if round_no == 2 else None
    folder = _artifact(entry, ctx)
    server = _Server(folder, ctx.threads)
    try:  # the server is stopped however this ends, an interrupt included
        try:
            server.start(prompts[workload.requests[0].key][:1])
        except RuntimeError as exc:  # recorded, not fatal: its cost is then infinite
            log.warning("race: %s could not be served: %s", entry.name, exc)
            failed = {"failed": 0, "requests": 0, "errors": [str(exc)[:200]], "clients": 1, "wall_s": 0}  # none sent
            return {s.key: {c.key: _cell(failed, 0.0) for c in workload.concurrency} for s in workload.requests}
        cells = {
            shape.key: _shape_cells(entry, server, shape, driven, first, prompts, round_no)
            for shape in workload.requests
        }
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return _with_derived(cells, workload, driven)


def _shape_cells(entry, server, shape, driven: list, first: dict | None, prompts: dict, round_no: int) -> dict:
    """One request shape at each driven level: driven now, or kept from the first round."""
    from optimize.evaluate.benchmark import OtherCpuUse

    cells = {}
    for level in driven:
        kept = first[shape.key][level.key] if first is not None else None
        per_client = (
            requests_per_client(level.clients, 1) if kept is None else second_round_requests(kept, level.clients)
        )
        if per_client is None:  # its first round already filled the second round's budget
            log.info("race: %s keeps its first round at %s, %d clients", entry.name, shape.key, level.clients)
            cells[level.key] = dict(kept or {}, kept_from_round=1)
            continue
        log.info(
            "race: serving %s (round %d): %s at %d clients, %d requests each",
            entry.name,
            round_no,
            shape.key,
            level.clients,
            per_client,
        )
        with OtherCpuUse() as others:
            figures = server.drive(prompts[shape.key], level.clients, per_client, shape.output)
        cells[level.key] = _cell(figures, others.share)
    return cells


def _with_derived(cells: dict, workload, driven: list) -> dict:
    """Every level's cell, those not driven derived from the one that was (one-at-a-time engines)."""
    if len(driven) == len(workload.concurrency):
        return cells
    (basis,) = driven
    for by_level in cells.values():
        for level in workload.concurrency:
            if level.key not in by_level:
                by_level[level.key] = derived_cell(by_level[basis.key], basis.clients, level.clients)
    return {shape: {c.key: by_level[c.key] for c in workload.concurrency} for shape, by_level in cells.items()}


def _cell(figures: dict, other_share: float) -> dict:
    ok = not figures.get("failed") and figures.get("requests")
    mean_ms = 1e3 * figures["clients"] * figures["wall_s"] / figures["requests"] if ok else None
    return {
        "tokens_per_s": figures.get("tokens_per_s"),
        "ttft_p95_ms": figures.get("ttft_p95_ms"),
        "ttft_p50_ms": figures.get("ttft_p50_ms"),
        "itl_p50_ms": figures.get("itl_p50_ms"),
        "itl_p95_ms": figures.get("itl_p95_ms"),
        "request_ms": round(mean_ms, 1) if mean_ms is not None else None,
        "requests": figures.get("requests"),
        "wall_s": figures.get("wall_s"),
        "output_tokens": figures.get("output_tokens"),
        "failed": figures.get("failed"),
        "errors": figures.get("errors"),
        "other_cpu_share": round(other_share, 3),
    }


def _artifact(entry, ctx) -> Path:
    """A minimal artifact of the candidate's engine files (the server verifies what it loads)."""
    from optimize.artifact import write_manifest

    folder = ctx.scratch / "race" / "served" / entry.name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(entry.model.engine_dir, folder)
    (folder / "candidate.json").unlink(missing_ok=True)  # the race cache's own record
    engine = dict(
        entry.model.engine,
        precision=entry.model.precision,
        task=entry.model.task,
        max_length=ctx.plan.model.max_length,
    )
    # Served with the server's defaults (the recipe's serve section is not part of the plan).
    write_manifest(folder, {"recipe": {"name": entry.name, "resolved": {}}, "engine": engine})
    return folder


class _Server:
    """`python -m serve` on the artifact on loopback (the served gate's server), warmed with one request."""

    def __init__(self, folder: Path, threads: int):
        from optimize.evaluate.served import ServedServer

        # serve's defaults, its request timeout for a model that generates included
        command = [sys.executable, "-m", "serve", str(folder), "--port", "0", "--allow-failed-gate"]
        command += ["--threads", str(threads)] if threads else []
        self.name = folder.name
        self.server = ServedServer("serve", command, "/v2/health/ready")

    def start(self, warm: list) -> None:
        import asyncio

        from optimize.evaluate.served import drive_async

        self.server.wait_ready()
        asyncio.run(drive_async(self.server.url, self.name, warm, 1, 1, 8, GENERATION_TIMEOUT_S))

    def drive(self, prompts: list, clients: int, per_client: int, output: int) -> dict:
        from optimize.evaluate.served import drive

        return drive(self.server.url, self.name, prompts, clients, per_client, output, GENERATION_TIMEOUT_S)

    def stop(self) -> None:
        self.server.stop()
