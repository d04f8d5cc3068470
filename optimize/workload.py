"""The workload: the traffic a recipe says its artifact will serve (`workload.batches` for encoders and
tensor models, `workload.requests` for causal LMs), resolved once into points with weights.

The race minimises the weighted cost over the points, the evaluation times every point, and the gate
checks the points it is asked to (`gate.speedup_batch_size=all`, `gate.request_shape=all`). A recipe
that declares nothing gets one point: the batch size (or request) the race and the gate used before
the workload existed, so such a recipe behaves exactly as it did.

`workload.concurrency` is how many requests are in flight at once, as levels with weights ({1: 0.5,
16: 0.5}, a list of levels with equal weights, or one number). A causal LM that declares none is
served at 1 and 16 clients, half each: the race times every passing candidate as served at each
level and the served gate checks each (optimize/tasks/lm_served.py); other tasks get the one level 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from optimize.errors import RecipeError

ALL = "all"


@dataclass(frozen=True)
class BatchPoint:
    batch: int
    weight: float  # share of calls at this batch size (the weights sum to 1)

    @property
    def label(self) -> str:
        return f"batch={self.batch}"

    @property
    def key(self) -> str:  # how metrics key their per-batch figures
        return str(self.batch)


# What a request shape's prompts are: "plain" ones cut from the evaluation text, or "grounded" chat
# requests that ask for a given paragraph back edited or summarised (optimize/evaluate/grounded.py),
# the work prompt lookup pays on; its `prompt` is then the paragraph's tokens.
REQUEST_KINDS = ("plain", "grounded")


@dataclass(frozen=True)
class RequestPoint:
    prompt: int  # prompt tokens (a grounded shape: the paragraph's, before the chat template's words)
    output: int  # generated tokens
    weight: float  # share of requests of this shape (the weights sum to 1)
    kind: str = "plain"  # one of REQUEST_KINDS

    @property
    def label(self) -> str:
        return f"shape={self.key}"

    @property
    def key(self) -> str:  # "64x64", "grounded:96x64"
        size = f"{self.prompt}x{self.output}"
        return size if self.kind == "plain" else f"{self.kind}:{size}"


@dataclass(frozen=True)
class ConcurrencyLevel:
    clients: int  # requests in flight at once
    weight: float  # share of the time the artifact serves this many (the weights sum to 1)

    @property
    def label(self) -> str:
        return f"concurrency={self.clients}"

    @property
    def key(self) -> str:
        return str(self.clients)


# What a causal LM recipe that declares no concurrency serves: one client, and sixteen at once.
DEFAULT_LM_CONCURRENCY = {1: 0.5, 16: 0.5}


@dataclass(frozen=True)
class Workload:
    batches: tuple[BatchPoint, ...]
    requests: tuple[RequestPoint, ...]
    concurrency: tuple[ConcurrencyLevel, ...] = (ConcurrencyLevel(1, 1.0),)
    declared: bool = False  # the recipe said what it serves (not the one-point default)

    @property
    def most_clients(self) -> int:
        return max(level.clients for level in self.concurrency)

    def batch_sizes_timed(self, evaluated: list[int]) -> list[int]:
        """evaluate.batch_sizes, then any declared batch size they lack: every point is timed."""
        return list(dict.fromkeys([*evaluated, *(p.batch for p in self.batches)]))

    def record(self) -> dict[str, Any]:
        return {
            "declared": self.declared,
            "batches": {p.key: p.weight for p in self.batches},
            "requests": [
                {"prompt": p.prompt, "output": p.output, "weight": p.weight, "kind": p.kind} for p in self.requests
            ],
            "concurrency": {level.key: level.weight for level in self.concurrency},
        }


def resolve(cfg, generates: bool = False) -> Workload:
    """The recipe's workload, checked: bad input is a RecipeError naming the key. `generates`: the task
    is a causal LM (its undeclared concurrency is DEFAULT_LM_CONCURRENCY)."""
    node = cfg.get("workload") if hasattr(cfg, "get") else None
    batches_raw = _plain(node.get("batches")) if node is not None else None
    requests_raw = _plain(node.get("requests")) if node is not None else None
    concurrency_raw = _plain(node.get("concurrency")) if node is not None else None
    concurrency = _concurrency(concurrency_raw) if concurrency_raw is not None else _default_concurrency(generates)
    for key in ("speedup_batch_size", "latency_batch_size"):
        selector_batch(cfg.gate.get(key, 1), f"gate.{key}")
    batches = _batches(batches_raw) if batches_raw is not None else _default_batches(cfg)
    requests = _requests(requests_raw) if requests_raw is not None else _default_requests(cfg)
    workload = Workload(batches, requests, concurrency, batches_raw is not None or requests_raw is not None)
    request_shape(cfg.gate.get("request_shape"), workload)
    return workload


def _plain(value) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def selector_batch(value, key: str) -> Optional[int]:
    """A gate batch selector: a batch size, or None for `all`."""
    if isinstance(value, str) and value.strip().lower() == ALL:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{key}={value}: give a batch size (a whole number of at least 1) or all")
    return value


def request_shape(value, workload: Workload) -> Optional[tuple[RequestPoint, ...]]:
    """The requests gate.request_shape selects: null -> the first, `all` -> every one, '1024x128' -> that one."""
    if value is None:
        return workload.requests[:1]
    text = str(value).strip().lower()
    if text == ALL:
        return workload.requests
    match = [p for p in workload.requests if p.key == text]
    if not match:
        known = ", ".join(p.key for p in workload.requests)
        raise RecipeError(f"gate.request_shape={value}: not a workload request (declared: {known}, or all)")
    return tuple(match)


def _whole(value, key: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{key}: {value!r} is not a whole number of at least 1")
    return value


def _weight(value, key: str) -> float:
    try:  # an int past float's range (10**400) overflows float()
        weight = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        weight = math.inf
    if not 0 < weight < math.inf:
        raise RecipeError(f"{key}: weight {repr(value)[:40]} must be a positive number, and finite")
    return weight


def _normalised(weights: list[float]) -> list[float]:
    # Scaled by the largest first: {1: 1e308, 2: 1e308} would overflow the sum to inf (weights 0.0).
    largest = max(weights)
    scaled = [w / largest for w in weights]
    total = sum(scaled)
    return [w / total for w in scaled]


def _batches(raw) -> tuple[BatchPoint, ...]:
    """{1: 0.7, 32: 0.3} or [1, 32] (equal weights)."""
    if isinstance(raw, dict):
        pairs = [(_whole(k, "workload.batches"), _weight(v, f"workload.batches.{k}")) for k, v in raw.items()]
    elif isinstance(raw, list):
        pairs = [(_whole(b, "workload.batches"), 1.0) for b in raw]
    else:
        raise RecipeError(f"workload.batches={raw!r}: give a list of batch sizes or {{batch size: weight}}")
    sizes = [b for b, _ in pairs]
    if not pairs or len(set(sizes)) != len(sizes):
        raise RecipeError(f"workload.batches={raw!r}: list each batch size once, at least one")
    return tuple(BatchPoint(b, w) for (b, _), w in zip(pairs, _normalised([w for _, w in pairs])))


def _requests(raw) -> tuple[RequestPoint, ...]:
    """[{prompt: 64, output: 64, weight: 0.5}, {prompt: 96, output: 64, kind: grounded}, ...] (weight
    default 1, kind default plain)."""
    form = "{prompt: TOKENS, output: TOKENS, weight: W, kind: plain | grounded}"
    if not isinstance(raw, list) or not raw:
        raise RecipeError(f"workload.requests: give a list of {form}")
    shapes = []
    for i, item in enumerate(raw):
        key = f"workload.requests[{i}]"
        if (
            not isinstance(item, dict)
            or not {"prompt", "output"} <= set(item)
            or set(item) - {"prompt", "output", "weight", "kind"}
        ):
            raise RecipeError(f"{key}={item!r}: give {form}")
        prompt, output = _whole(item["prompt"], f"{key}.prompt"), _whole(item["output"], f"{key}.output")
        if prompt < 2 or output < 2:
            raise RecipeError(f"{key}: prompt and output must be at least 2 tokens")
        kind = item.get("kind", "plain")
        if kind not in REQUEST_KINDS:
            raise RecipeError(f"{key}.kind={kind!r}: use one of {', '.join(REQUEST_KINDS)}")
        shapes.append((prompt, output, _weight(item.get("weight", 1.0), key), kind))
    if len({(p, o, k) for p, o, _, k in shapes}) != len(shapes):
        raise RecipeError("workload.requests: list each prompt/output shape of a kind once")
    weights = _normalised([w for _, _, w, _ in shapes])
    return tuple(RequestPoint(p, o, w, k) for (p, o, _, k), w in zip(shapes, weights))


def _concurrency(raw) -> tuple[ConcurrencyLevel, ...]:
    """16, [1, 16] (equal weights) or {1: 0.7, 16: 0.3}; every level a whole number of at least 1."""
    shown = f"workload.concurrency={raw!r}"
    if isinstance(raw, dict):
        pairs = [(_level(k, shown), _weight(v, f"{shown}: level {k}")) for k, v in raw.items()]
    elif isinstance(raw, list):
        pairs = [(_level(c, shown), 1.0) for c in raw]
    else:
        pairs = [(_level(raw, shown), 1.0)]
    levels = [c for c, _ in pairs]
    if not pairs or len(set(levels)) != len(levels):
        raise RecipeError(f"{shown}: list each level once, at least one")
    return tuple(ConcurrencyLevel(c, w) for (c, _), w in zip(pairs, _normalised([w for _, w in pairs])))


def _level(value, shown: str) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecipeError(f"{shown}: {value!r} is not a whole number of at least 1 (clients at once)")
    return value


def _default_concurrency(generates: bool) -> tuple[ConcurrencyLevel, ...]:
    """Causal LMs: DEFAULT_LM_CONCURRENCY; every other task: one request at a time."""
    return _concurrency(dict(DEFAULT_LM_CONCURRENCY)) if generates else (ConcurrencyLevel(1, 1.0),)


def _default_batches(cfg) -> tuple[BatchPoint, ...]:
    """The batch size the race was won at before workloads: the gate's speedup (or p95) batch, else
    the first timed one; `all` there means every evaluated batch size."""
    gate, evaluated = cfg.gate, list(cfg.evaluate.batch_sizes)
    if gate.get("min_speedup") is not None:
        chosen = selector_batch(gate.get("speedup_batch_size", 1), "gate.speedup_batch_size")
    elif gate.get("max_p95_ms") is not None:
        chosen = selector_batch(gate.get("latency_batch_size", 1), "gate.latency_batch_size")
    else:
        chosen = evaluated[0] if evaluated else 1
    sizes = evaluated if chosen is None else [chosen]
    return tuple(BatchPoint(b, w) for b, w in zip(sizes, _normalised([1.0] * len(sizes))))


def _default_requests(cfg) -> tuple[RequestPoint, ...]:
    """One request of evaluate.task_params' prompt_tokens and new_tokens (the LM task's defaults)."""
    params = _plain(cfg.evaluate.get("task_params")) or {}
    prompt, output = params.get("prompt_tokens", 64), params.get("new_tokens", 64)
    if not isinstance(prompt, int) or not isinstance(output, int):
        return (RequestPoint(64, 64, 1.0),)  # the task's own config check names the bad key
    return (RequestPoint(prompt, output, 1.0),)
