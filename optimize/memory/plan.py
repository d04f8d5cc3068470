"""Each stage's peak memory estimated before anything loads, from the model's size and the builders'
bytes per parameter, against the memory this machine lets the run use.

The run holds the source model for its baseline the whole time (memory-mapped in its own precision,
or a GGUF's FP32 conversion; its resident pages are given back while it idles, optimize/evaluate/idle.py,
which the plan does not count on: a builder that streams the model reads them again, and only the second
phase of a two-phase build, PHASES, is planned without them); each candidate's builder
runs in a child process of its own, one at a time, and needs its own bytes on top (BUILD); the
candidates' scoring loads their engines one at a time beside the baseline (ENGINE), and each is then
timed as served in a server of its own. A stage that cannot fit refuses its candidate in the race's table
with the figure; a run whose baseline and cheapest build cannot fit is refused at plan time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from optimize.errors import RecipeError
from optimize.memory.shape import ModelShape

GB = 1e9

# Each stage's bytes in one table: (fixed GB, bytes per parameter), where each came from beside it. The
# fixed part is the process and its runtimes' own (imports, kernels): at SmolLM2's 135M parameters it
# is most of a builder's peak, so a slope needs a point at size. "Measured" peaks are a process tree's
# proportional set size (benchmarks/lm_at_size.py --builders-on, SmolLM2-135M's FP32 folder, 2-core
# AMD EPYC, 2026-12-06, load average 7-8); "the 1.5B run's" are Qwen2-1.5B (1.54B parameters, a Q4_K/Q6_K
# GGUF dequantized to FP32) on a 2-core, 23 GB machine, where the kernel killed the GenAI builder.
# The run holding its baseline: the interpreter and its imports (fixed, the 1.5B run: ~1 GB), then
# what baseline_memory (below) measured per parameter: private bytes (0.85 B/param) and the
# weights as memory-mapped file pages in the precision the baseline reads them (a bf16/fp16 folder's
# own, a GGUF's FP32 conversion). The pages are counted as needed: every forward reads them again.
RESIDENT_FIXED_GB = 1.0
PRECISION_OF = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "gguf blocks": "gguf"}
BUILD = {
    # ONNX Runtime GenAI's model builder, a subprocess loading its own FP32 copy: measured 2.77 GB on
    # SmolLM2 (int4 k_quant_mixed), the 1.5B run's 13.8 GB at 1.54B: the line through both.
    "onnxruntime_genai": (1.7, 7.85),
    "onnxruntime_genai_gguf": (1.7, 7.85),  # the same builder on the dequantized file (assumed alike)
    # optimum-intel's export then NNCF with data (AWQ, scale estimation, GPTQ, LoRA, Hessian mixes): the
    # 1.5B run grew from 9.8 GB to 18.9 GB during it at 1.54B (6.1 B/param); fixed part as below.
    "openvino_genai:data": (0.7, 6.1),
    # The export with data-free rounding (an FP32 copy traced, its IR compressed): measured 1.33 GB on
    # SmolLM2 (int8) and 6.84 GB on a random bf16 Llama of Llama-3.2-1B's shape (1.07B parameters;
    # benchmarks/lm_at_size.py --builders-on, 2-core AMD EPYC Zen 4, 2026-12-06): the line through both.
    "openvino_genai": (0.53, 5.9),
    # OpenVINO GenAI's GGUF reader building and compiling its IR from the file (the pipeline's build):
    # measured 0.40 GB on SmolLM2's Q4_1 file (0.13B parameters) and 3.6 GB on the Q8_0 file of a random
    # bf16 Llama of Llama-3.2-1B's shape (1.07B), a fresh process each (2-core AMD EPYC Zen 4,
    # 2026-12-06): the line through both, rounded up.
    "openvino_genai_gguf": (0.1, 3.3),
    "native_gguf": (0.3, 1.2),  # a copy of the file's blocks repacked for the kernels (estimated)
    # The GGUF writer streaming the memory-mapped model (Q4_K_M with its importance matrix, the native
    # kernels' checks of the file): growth of the forked builder over the run holding the model, measured
    # 0.58 GB at 0.34B and 0.75 GB at 0.59B parameters (random bf16 Llamas of Llama-3.2-1B's widths, 4
    # and 8 layers, SmolLM2's vocabulary; benchmarks/lm_at_size.py --builders-on --builder 'gguf Q4_K_M';
    # 2-core AMD EPYC Zen 4, 2026-12-06, load average 7-12): 0.33 GB + 0.73 B/param. Both shapes share
    # one 100M-parameter head, whose FP32 upcast for the importance matrix's forward sits in that fixed
    # part; a released 128k vocabulary makes the head ~21% of a 1B model (4 bytes each upcast), so the
    # slope carries 0.6 B/param more. The writer it replaced held every tensor in FP32 and every
    # quantized one: 1.64 GB at 0.34B (4.8 B/param), 2.5 GB or more at 0.59B, the same machine.
    "gguf": (0.35, 1.3),
}
# Builds in two phases in one child: the GGUF writer streaming the memory-mapped source, then OpenVINO
# GenAI's reader building its IR from the written file once the source's pages are given back
# (optimize/compile/gguf_export.give_back_source_pages). Only the first phase holds the source's pages.
PHASES = {"gguf:openvino": ("gguf", "openvino_genai_gguf")}
DEFAULT_BUILD = (1.7, 7.85)  # an engine method not in the table: as the costliest measured builder
# A built engine's weights per source parameter as the scoring stage loads them beside the baseline:
# INT4 with 8-bit heads and scales, INT8, or the file's own blocks (GGUF sources: bytes on disk).
ENGINE = {"int4": 0.7, "int8": 1.2, "default": 4.0}
RUNTIME_BYTES = 0.4 * GB  # a runtime's own allocations beside its weights (ONNX Runtime, OpenVINO)
# A generating engine in a process of its own (the race's server with its load clients, the final
# evaluation's timing worker): its interpreter, runtime and generation pipeline beyond the engine's
# weights and the KV cache. Measured at Llama-3.2-1B's shape (random bf16, 1.07B parameters, 2-core
# AMD EPYC Zen 4, 2026-12-06 and -07): the served rounds peaked at 5.1 and 5.4 GB in two runs with the
# baseline's pages given back, the Q8_0 file in OpenVINO GenAI at 16 clients of 1,152 tokens: up to
# 1.3 GB over the rest of this plan (the final evaluation of the second run, 4.8 GB, is planned at 4.8).
# At Llama-3.2-3B's shape (2.97B, 2026-12-07) the final evaluation measured 9.1 GB against 9.5 planned,
# the native Q8_0 winner loaded in the run and in its timing worker; the served round 6.7 against 10.5
# (one client driven, sixteen derived: no KV cache of sixteen requests held).
SERVER_FIXED_GB = 1.3
# A GGUF file the writer makes, bytes per parameter by file type: the types' block sizes (Q8_0 34 bytes
# per 32 values, Q4_K 144 per 256, Q6_K 210 per 256, ...) in llama.cpp's mixes, the head and part of
# the layers at 6 bits (estimated from the types, not measured).
WRITTEN_GGUF = {"Q8_0": 1.07, "Q6_K": 0.83, "Q5_K_M": 0.72, "Q4_K_M": 0.62, "Q4_0": 0.58}

# Keys of an OpenVINO GenAI candidate's parameters that make NNCF read calibration activations.
_DATA_AWARE = ("awq", "scale_estimation", "gptq", "lora_correction", "sensitivity_metric")


# Private memory of a causal LM's baseline per parameter, beyond the interpreter and its imports: what
# loading memory-maps leaves unmapped, one module's FP32 upcast at a time and a scoring window's
# activations. Measured on a 244M-parameter Llama (bf16 folder, and its Q8_0 GGUF through the FP32
# conversion): 200 and 208 MB after loading and scoring two 512-token windows (docs/own-model.md).
BASELINE_PRIVATE_PER_PARAMETER = 0.85
# The weights themselves are file pages of the checkpoint (or of a GGUF's FP32 conversion), read by
# every forward: the kernel drops them under pressure and reads them again (slower, never killed).
BASELINE_FILE_BYTES_PER_PARAMETER = {"bfloat16": 2, "float16": 2, "float32": 4, "gguf": 4}


def baseline_memory(parameters: int, precision: str) -> dict[str, int]:
    """What a causal LM's baseline holds, for the memory plan: `private` bytes (which must fit) and
    `file_pages` (the weights, memory-mapped). `precision`: source_precision's answer for a folder,
    or "gguf" for a GGUF file."""
    return {
        "private": int(parameters * BASELINE_PRIVATE_PER_PARAMETER),
        "file_pages": int(parameters * BASELINE_FILE_BYTES_PER_PARAMETER.get(precision, 4)),
    }


def build_key(engine: str, params: dict) -> str:
    """The BUILD (or PHASES) entry of a build by its engine and what its parameters ask of the builder."""
    if engine == "openvino_genai" and any(params.get(k) for k in _DATA_AWARE):
        return "openvino_genai:data"
    if engine == "gguf" and params.get("serve_with") == "openvino_genai_gguf":
        return "gguf:openvino"
    return engine


def build_bytes(engine: str, params: dict, parameters: int) -> float:
    """What a builder's process needs at its peak for a model of `parameters` (a two-phase build: the
    larger phase)."""
    key = build_key(engine, params)
    return max(_bytes(part, parameters) for part in PHASES.get(key, (key,)))


def _bytes(key: str, parameters: int) -> float:
    fixed_gb, per_parameter = BUILD.get(key, DEFAULT_BUILD)
    return fixed_gb * GB + per_parameter * parameters


def engine_bytes(engine: str, params: dict, shape: ModelShape) -> float:
    """What a built candidate's engine holds when loaded, from its precision."""
    if engine == "gguf" and params.get("type") in WRITTEN_GGUF:  # a file written from the model
        return WRITTEN_GGUF[params["type"]] * shape.parameters + RUNTIME_BYTES
    if "gguf" in engine:
        return shape.disk_bytes * 1.1 + RUNTIME_BYTES
    text = " ".join(str(v) for v in params.values())
    precision = "int4" if "int4" in text else "int8" if "int8" in text else "default"
    return ENGINE[precision] * shape.parameters + RUNTIME_BYTES


@dataclass(frozen=True)
class Build:
    """One engine build the run plans: a race candidate, or the recipe's one engine method."""

    name: str
    engine: str
    params: dict = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, spec) -> "Build":
        """A race candidate's build (optimize/compile/race/candidates.Candidate: its engine and parameters)."""
        return cls(name, spec.engine, {**spec.engine_params, **spec.quantize_params})


@dataclass
class MemoryPlan:
    shape: ModelShape
    free: int  # bytes free to the run when it was planned
    limit: int  # the most the run may use in all (machine, cgroup, OPTIMIZE_MEMORY_LIMIT_GB)
    builds: list[Build]
    # A generating model's workload: the KV tokens its servers hold at once (the most clients at the
    # longest request) and one request's; 0: nothing is served or timed generating.
    served_tokens: int = 0
    request_tokens: int = 0

    @property
    def held(self) -> dict[str, int]:
        precision = PRECISION_OF.get(self.shape.dtype, self.shape.dtype)
        return baseline_memory(self.shape.parameters, precision)

    @property
    def resident(self) -> float:
        return RESIDENT_FIXED_GB * GB + self.held["private"] + self.held["file_pages"]

    def build_need(self, build: Build) -> float:
        """The run's peak while `build` builds: the resident baseline and the builder's own bytes; in a
        two-phase build (PHASES) the second phase beside the baseline without its weight pages."""
        key, parameters = build_key(build.engine, build.params), self.shape.parameters
        if key not in PHASES:
            return self.resident + build_bytes(build.engine, build.params, parameters)
        first, second = PHASES[key]
        without_pages = self.resident - self.held["file_pages"]
        return max(self.resident + _bytes(first, parameters), without_pages + _bytes(second, parameters))

    def scoring_need(self) -> float:
        """The baseline beside the largest candidate's loaded engine (the race scores one at a time)."""
        return self.resident + self.largest_engine()

    def largest_engine(self) -> float:
        """The largest of the candidates' loaded engines (one is loaded at a time)."""
        return max((engine_bytes(b.engine, b.params, self.shape) for b in self.builds), default=0.0)

    def generating_need(self, tokens: int) -> float:
        """The run's peak while a candidate generates in a process of its own with `tokens` in its KV
        cache: the baseline without its weight pages (given back while it idles) beside the largest
        candidate's engine, its KV cache and the server's own part."""
        without_pages = self.resident - self.held["file_pages"]
        return without_pages + self.largest_engine() + tokens * self.shape.kv_bytes_per_token + SERVER_FIXED_GB * GB

    def fits(self, build: Build) -> bool:
        return self.build_need(build) <= self.free

    def stages(self) -> dict[str, float]:
        """Each stage's planned peak in bytes."""
        planned = {"baseline": self.resident}
        planned.update({f"build {b.name}": self.build_need(b) for b in self.builds})
        planned["scoring"] = self.scoring_need()
        if self.served_tokens:
            planned["served"] = self.generating_need(self.served_tokens)
        if self.request_tokens:
            # Without a race the baseline is sampled and timed here, its pages read back; then the winner
            # is timed in a worker of its own beside its runner in this process (after a race, the
            # baseline's figures and sample are the race's and its pages stay given back).
            planned["evaluation"] = max(self.resident, self.generating_need(self.request_tokens))
        return planned

    def record(self) -> dict:
        return {
            "parameters": self.shape.parameters,
            "source": self.shape.words(),
            "free_gb": round(self.free / GB, 2),
            "limit_gb": round(self.limit / GB, 2),
            "planned_peak_gb": {name: round(need / GB, 2) for name, need in self.stages().items()},
            "refused": [b.name for b in self.builds if not self.fits(b)],
        }

    def lines(self) -> list[str]:
        head = f"memory plan: {self.shape.words()}; {self.free / GB:.1f} GB free"
        rows = [f"  {name}: ~{need / GB:.1f} GB" for name, need in self.stages().items()]
        return [head, *rows]


def make(shape: ModelShape, builds: Iterable[Build], free: Optional[int] = None, workload=None) -> MemoryPlan:
    """The plan of a run building `builds`; `workload` (optimize.workload.Workload) where the model
    generates, for its served and evaluation stages."""
    from engines import memprobe

    free = memprobe.free_bytes() if free is None else free
    longest = max((r.prompt + r.output for r in workload.requests), default=0) if workload else 0
    served = longest * workload.most_clients if workload else 0
    return MemoryPlan(shape, free, memprobe.limit_bytes(), list(builds), served, longest)


def free_now() -> int:
    """What is free to the run now, beside what it and its children hold already."""
    import os

    from engines import memprobe

    return memprobe.free_bytes(memprobe.tree_rss_bytes(os.getpid()))


def check_run(plan: MemoryPlan) -> None:
    """One line, exit 2, when the run cannot fit at all: its baseline alone, or with its cheapest build."""
    if plan.builds:
        cheapest = min(plan.builds, key=plan.build_need)
        need, what = plan.build_need(cheapest), f"its baseline and its cheapest build ({cheapest.name})"
    else:
        need, what = plan.resident, "its baseline"
    if need > plan.free:
        raise RecipeError(
            f"model.source: a model of {plan.shape.words()} needs ~{need / GB:.1f} GB for {what}; "
            f"{plan.free / GB:.1f} GB is free here"
        )


def refusal(build: Build, parameters: int, free: int) -> Optional[str]:
    """Why a candidate cannot be built now (its builder's bytes over what is free), or None. `free`
    is what is free to the run while it holds the baseline, so only the builder's own bytes count."""
    need = build_bytes(build.engine, build.params, parameters)
    if need <= free:
        return None
    return f"refused for memory: its build needs ~{need / GB:.1f} GB, {free / GB:.1f} GB free"


# How many candidates a race builds by default at each size: (up to this many parameters, at most this
# many candidates). A 135M model races the whole default set in 15-30 minutes on 2 cores; the build,
# scoring and served timing of each candidate grow with the parameter count.
CANDIDATES_BY_SIZE = ((0.6e9, None), (1.5e9, 3), (4e9, 2), (float("inf"), 1))
# The build's relative cost by what its parameters ask of the builder, so the cheapest are kept: GPTQ's
# error feedback about 2x AWQ with scale estimation on SmolLM2 (candidates.py), LoRA correction 1.4x less.
_COSTLIER = (("gptq", 3.0), ("lora_correction", 2.0), ("awq", 1.5))


def candidate_limit(parameters: int) -> Optional[int]:
    return next(limit for ceiling, limit in CANDIDATES_BY_SIZE if parameters <= ceiling)


def cheapest_builds(builds: list[Build], parameters: int) -> list[Build]:
    """The builds a default race keeps at this size: all below 0.6B parameters, else the cheapest
    (by _COSTLIER) up to candidate_limit, in their order."""
    limit = candidate_limit(parameters)
    if limit is None or len(builds) <= limit:
        return list(builds)
    cost = {b.name: next((c for key, c in _COSTLIER if b.params.get(key)), 1.0) for b in builds}
    by_cost = sorted(
        builds, key=lambda b: (cost[b.name], build_bytes(b.engine, b.params, parameters))
    )  # then the leanest
    kept = {b.name for b in by_cost[:limit]}
    return [b for b in builds if b.name in kept]
