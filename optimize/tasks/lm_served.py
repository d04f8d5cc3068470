"""Served latency in the gate: a causal LM judged on what clients of the real server measure.

A recipe that sets `gate.max_served_ttft_p95_ms` or `gate.min_served_tokens_per_s` has, after the
in-process evaluation, `python -m serve` started on the candidate artifact (on 127.0.0.1, with the
serve settings the artifact records) and driven at each level of `workload.concurrency` (or only
`gate.served_concurrency` when it names a number) by that many closed-loop streaming clients, each
sending `gate.served_requests_per_client` requests of held-out prompts. What they measured is the
candidate's `served` block (every level under `levels`), which the gate's served checks read, one
check per level when there are several (max_served_ttft_p95_ms[concurrency=16]). The load is the one
benchmarks/serve_llm_load.py drives (optimize/evaluate/served.py).

With `gate.served_structured_share` above 0, that share of the requests carry a `response_format`
json_schema; every constrained reply is parsed and validated against it, and the check
`max_served_invalid_structured` (0 unless the recipe sets it) fails the gate on any that does not
match (a reply cut by max_tokens before it was whole is counted apart, not judged).

Like every timed check these fail as untrusted when other processes took more than a quarter of the
CPUs while the load ran; a request that failed (a 4xx or 5xx, a stream cut short) leaves the figures
unmeasured, so the checks fail rather than judge the requests that happened to succeed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimize.errors import RecipeError
from optimize.plan import GateSettings
from optimize.workload import ALL

if TYPE_CHECKING:
    from optimize.context import Context
    from optimize.plan import Plan
    from optimize.workload import Workload

log = logging.getLogger(__name__)

# Seconds the candidate's server may take to load before the served checks fail as not measured (a
# server that exits, or answers the readiness check with a 4xx, fails them at once).
READY_TIMEOUT_S = 180

SERVED_THRESHOLDS = ("max_served_ttft_p95_ms", "min_served_tokens_per_s", "max_served_invalid_structured")
# The gate keys that shape the served load (not thresholds: nothing is checked against them).
SERVED_SETTINGS = (
    "served_concurrency",
    "served_prompt_tokens",
    "served_output_tokens",
    "served_requests_per_client",
    "served_structured_share",
)


@dataclass(frozen=True)
class ServedLoad:
    levels: tuple[int, ...]  # clients at once: the load is driven once at each, one check each
    prompt_tokens: int
    output_tokens: int
    requests_per_client: int
    structured_share: float = 0.0  # of the requests, constrained to a JSON schema

    @property
    def clients(self) -> int:  # the most clients of any level (the figures at the top of the block)
        return max(self.levels)

    @property
    def key(self) -> str:
        clients = "/".join(str(c) for c in self.levels)
        return f"{clients} clients, {self.prompt_tokens}x{self.output_tokens}"


def asked(section: GateSettings | Mapping[str, Any]) -> bool:
    """Whether the gate measures the served load: a served threshold, or a structured share (which
    implies its check)."""
    gate = GateSettings.of(section)
    return any(gate[key] is not None for key in SERVED_THRESHOLDS) or gate.served_structured_share != 0


def _share(gate: GateSettings) -> float:
    value = gate.served_structured_share
    if not 0 <= value <= 1:
        raise RecipeError(f"gate.served_structured_share={value}: give a share of the requests from 0 to 1")
    return value


def _whole(value: int | None, key: str, default: int) -> int:
    value = default if value is None else value
    if value < 1:
        raise RecipeError(f"gate.{key}={value}: give a whole number of at least 1")
    return value


def levels(section: GateSettings | Mapping[str, Any], workload: Workload) -> tuple[int, ...]:
    """The clients the served load is driven with: gate.served_concurrency (a number), else (null or
    all) every level of workload.concurrency."""
    value = GateSettings.of(section).served_concurrency
    if value is None or (isinstance(value, str) and value.strip().lower() == ALL):
        return tuple(level.clients for level in workload.concurrency)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RecipeError(f"gate.served_concurrency={value}: give a whole number of at least 1, or all")
    return (value,)


def settings(section: GateSettings | Mapping[str, Any], workload: Workload) -> ServedLoad:
    """The load the served checks are measured under: the gate's served_* keys, else the workload's
    concurrency levels and first request shape."""
    gate = GateSettings.of(section)
    first = workload.requests[0]
    return ServedLoad(
        levels=levels(gate, workload),
        prompt_tokens=_whole(gate.served_prompt_tokens, "served_prompt_tokens", first.prompt),
        output_tokens=_whole(gate.served_output_tokens, "served_output_tokens", first.output),
        requests_per_client=_whole(gate.served_requests_per_client, "served_requests_per_client", 2),
        structured_share=_share(gate),
    )


def check_plan(plan: Plan) -> None:
    """Refuse at plan time what cannot be measured: served checks on a task serve does not stream, or
    with timing turned off."""
    if not asked(plan.gate):
        return
    key = next((k for k in SERVED_THRESHOLDS if plan.gate[k] is not None), "served_structured_share")
    if not plan.task.generates:
        task = plan.model.task
        raise RecipeError(f"gate.{key}: served latency is measured for causal LMs (model.task=causal_lm), not {task}")
    if not plan.evaluate.latency:
        raise RecipeError(f"gate.{key}: served latency is a timing, and evaluate.latency=false turns timing off")
    load = settings(plan.gate, plan.workload)
    if plan.gate.max_served_invalid_structured is not None and not load.structured_share:
        raise RecipeError(
            "gate.max_served_invalid_structured: no served request is constrained; set gate.served_structured_share"
        )
    from serve.config import ServeConfig

    cap = ServeConfig().max_tokens  # the gate's server runs with serve's default --max-tokens
    if load.output_tokens > cap:
        raise RecipeError(
            f"gate.served_output_tokens={load.output_tokens}: the served gate's server answers at most {cap} "
            "tokens per request (python -m serve --max-tokens), so every request would be refused"
        )


def check_context(plan: Plan, ctx: Context) -> None:
    """Once the source is loaded (before anything is built): the served requests' prompt and output
    fit the model's context, or the server refuses every one of them."""
    if not asked(plan.gate):
        return
    context = getattr(getattr(ctx.loaded_source().module, "config", None), "max_position_embeddings", None)
    if not isinstance(context, int):
        return
    load = settings(plan.gate, plan.workload)
    if load.prompt_tokens + load.output_tokens > context:
        raise RecipeError(
            f"gate.served_prompt_tokens + gate.served_output_tokens = {load.prompt_tokens} + {load.output_tokens} "
            f"tokens do not fit the model's context of {context} tokens"
        )


def measure(stage: Path, ctx: Context, load: ServedLoad) -> dict:
    """Serve the staged artifact (its manifest written), drive the load at each level, return what the
    clients saw: the most clients' figures, and every level's under `levels` (what per-level checks
    read), each with the share of the CPUs other processes used meanwhile."""
    from optimize.evaluate.generation import Tokens, prompts_of

    prompts = prompts_of(Tokens(ctx), ctx.evaluation_data().items, load.prompt_tokens)
    flags = ("--threads", str(ctx.threads)) if ctx.threads else ()
    log.info("served load: %s, %d requests per client", load.key, load.requests_per_client)
    at = {str(c): _measure_at(stage, prompts, flags, load, c) for c in load.levels}
    return {**at[str(load.clients)], "levels": at}


def _measure_at(stage: Path, prompts: list, flags: tuple, load: ServedLoad, clients: int) -> dict:
    from optimize.evaluate.benchmark import OtherCpuUse
    from optimize.evaluate.served import ServerNotReady, served_load

    with OtherCpuUse() as others:
        try:
            figures = served_load(
                stage,
                prompts,
                clients,
                load.requests_per_client,
                load.output_tokens,
                flags,
                structured_share=load.structured_share,
                ready_timeout_s=READY_TIMEOUT_S,
            )
        except ServerNotReady as exc:  # every served check then fails as not measured
            log.warning("served load: the server on the candidate never became ready: %s", exc)
            figures = not_served(load, clients, str(exc))
    return {
        **figures,
        "prompt_tokens": load.prompt_tokens,
        "requested_tokens": load.output_tokens,
        "other_cpu_share": round(others.share, 3),
    }


def not_served(load: ServedLoad, clients: int, reason: str) -> dict:
    """The figures of a load whose server never became ready: every request failed, none measured."""
    requests = clients * load.requests_per_client
    return {"clients": clients, "requests": requests, "failed": requests, "errors": [reason[:300]]}


def table_rows(served: dict) -> list[list[str]]:
    """End-of-run table rows: [metric, baseline, candidate, note], for each level the load was driven at."""
    levels = served.get("levels") or {str(served.get("clients")): served}
    return [row for figures in levels.values() for row in _level_rows(figures)]


def _level_rows(served: dict) -> list[list[str]]:
    at = f"{served['clients']} clients, {served['prompt_tokens']}x{served['requested_tokens']}"
    failed = f"{served['failed']} of {served['requests']} requests failed" if served.get("failed") else ""
    rows = [["served output tok/s (all clients)", "", str(served.get("tokens_per_s")), failed or at]]
    for pct in ("p50", "p95"):
        rows.append([f"served time to first token {pct} ms", "", str(served.get(f"ttft_{pct}_ms")), at])
    rows.append(["served inter-token latency p95 ms", "", str(served.get("itl_p95_ms")), at])
    structured = served.get("structured")
    if structured:
        cut = f", {structured['cut']} cut by max_tokens" if structured.get("cut") else ""
        note = f"{structured['requests']} of {served['requests']} requests constrained to a JSON schema{cut}"
        rows.append(["served constrained replies invalid", "", str(structured.get("invalid")), note])
    return rows
