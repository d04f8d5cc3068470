"""The candidates the race knows, which it builds by default for a task, how long each build may
take, and the race's recipe config (engine.method=auto)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from optimize.errors import RecipeError


@dataclass(frozen=True)
class Candidate:
    engine: str
    engine_params: dict = field(default_factory=dict)
    quantize: Optional[str] = None
    quantize_params: dict = field(default_factory=dict)


# The candidates the race knows, by name. ORT INT8 comes as the sensitivity-fallback variant (a few
# MatMuls kept FP32 until the calibration cosine holds) and as all-INT8; static QDQ with the settings
# that held min cosine 0.99 on MiniLM (percentile calibration, GELU-fed MatMuls kept FP32).
CANDIDATES: dict[str, Candidate] = {
    "ort_fp32": Candidate("onnx"),
    "ort_int8_dynamic": Candidate("onnx", quantize="ort_int8_dynamic"),
    "ort_int8_dynamic_all": Candidate(
        "onnx", quantize="ort_int8_dynamic", quantize_params={"fallback_min_cosine": None}
    ),
    "ort_int8_qattention": Candidate("onnx", quantize="ort_int8_dynamic", quantize_params={"quantize_attention": True}),
    "ort_int8_static": Candidate(
        "onnx",
        quantize="ort_int8_static_qdq",
        quantize_params={
            "op_types": ["MatMul"],
            "calibrate_method": "percentile",
            "percentile": 99.999,
            "exclude_consumers_of": ["BiasGelu", "Gelu", "FastGelu"],
            "fallback_min_cosine": 0.995,
            "max_fp32_nodes": 6,
        },
    ),
    "openvino_f32": Candidate("openvino", {"precision": "f32"}),
    "openvino_bf16": Candidate("openvino", {"precision": "bf16"}),
    "openvino_int8": Candidate("openvino", {"precision": "int8"}),
    # NNCF's accuracy control reverts the INT8 layers that cost the gate's cosine to float (bf16 where
    # the CPU has it), so an INT8 that fails the gate all-INT8 can still ship mostly INT8.
    "openvino_mixed": Candidate("openvino_mixed"),
}
# Causal LMs: decoders with KV cache from ONNX Runtime GenAI and OpenVINO GenAI, weight-only INT4
# (with 8-bit LM head and sensitive layers where the builder offers it) and INT8.
CANDIDATES.update(
    {
        "ort_genai_int4": Candidate("onnxruntime_genai", {"precision": "int4", "accuracy_level": 4}),
        "ort_genai_int4_k_quant_mixed": Candidate(
            "onnxruntime_genai", {"precision": "int4", "accuracy_level": 4, "algo_config": "k_quant_mixed"}
        ),
        # HQQ (ONNX Runtime's half-quadratic solver, no calibration data) on the builder's fp32 decoder,
        # the LM head at 8 bits. ONNX Runtime 1.32's CPU MatMulNBits has no fast path for HQQ's float
        # zero points: SmolLM2 decoded at 13.7 tok/s, 0.65x PyTorch FP32.
        "ort_genai_int4_hqq": Candidate(
            "onnxruntime_genai", {"precision": "int4", "accuracy_level": 4, "algo_config": "hqq"}
        ),
        "openvino_genai_int4": Candidate("openvino_genai", {"weight_format": "int4_asym", "group_size": 64}),
        "openvino_genai_int4_g32": Candidate("openvino_genai", {"weight_format": "int4_asym", "group_size": 32}),
        # Data-aware INT4 (AWQ + scale estimation on the calibration text): SmolLM2 +15.5% perplexity at
        # group 64 against +32% for plain rounding.
        "openvino_genai_int4_awq": Candidate(
            "openvino_genai", {"weight_format": "int4_asym", "group_size": 64, "awq": True, "scale_estimation": True}
        ),
        "openvino_genai_int4_g32_awq": Candidate(
            "openvino_genai", {"weight_format": "int4_asym", "group_size": 32, "awq": True, "scale_estimation": True}
        ),
        "openvino_genai_int8": Candidate("openvino_genai", {"weight_format": "int8_asym"}),
    }
)
# The OpenVINO GenAI builds served (and scored) with a quantized KV cache: u8 (keys by channel, values
# by token) holds about 3.4x the tokens per GB of f32, and is what the shipped engine config
# (recipes/engine/openvino_genai_int4.yaml) serves with, so these are the rows the race builds by
# default; the rows above keep the f32 cache, to be measured by name. Computed in f32, named as the
# engine config names it (the CPU plugin's own default is bf16 where the CPU has it). u4 with value
# groups of 32 channels is there to be measured (on OpenVINO 2026.4 its blocks take more bytes than
# u8's: engines/openvino/genai_batch.py). Prompt lookup: n-gram speculation from the prompt, for
# input-grounded work at low concurrency (on SmolLM2's INT8 build, edits and summaries of a given
# paragraph: 2.52x plain at one client, 0.78x at 16, 2-core Zen 5), so by name, for a workload of
# `grounded` shapes where the race times it at the declared concurrency. Its builds keep activations
# in f32 (engine.params.dynamic_quantization_group_size, 0 by default with prompt lookup), so its
# greedy output is the plain engine's on the same IR.
_AWQ = {"weight_format": "int4_asym", "group_size": 64, "awq": True, "scale_estimation": True}
_KV_U8 = {"inference_precision": "f32", "kv_cache_precision": "u8"}
CANDIDATES.update(
    {
        "openvino_genai_int4_awq_kv_u8": Candidate("openvino_genai", {**_AWQ, **_KV_U8}),
        "openvino_genai_int4_g32_awq_kv_u8": Candidate("openvino_genai", {**_AWQ, "group_size": 32, **_KV_U8}),
        "openvino_genai_int8_kv_u8": Candidate("openvino_genai", {"weight_format": "int8_asym", **_KV_U8}),
        "openvino_genai_int4_awq_kv_u4_g32": Candidate(
            "openvino_genai", {**_AWQ, "kv_cache_precision": "u4", "kv_cache_group_size": 32}
        ),
        "openvino_genai_int4_awq_kv_u8_prompt_lookup": Candidate(
            "openvino_genai", {**_AWQ, **_KV_U8, "prompt_lookup": True}
        ),
        "openvino_genai_int8_kv_u8_prompt_lookup": Candidate(
            "openvino_genai", {"weight_format": "int8_asym", **_KV_U8, "prompt_lookup": True}
        ),
    }
)
# INT4 beyond AWQ + scale estimation, from NNCF, all calibrated on the recipe's calibration text:
# LoRA correction (rank-8 INT8 adapters fitted per layer to what 4 bits lost), GPTQ (error feedback
# column by column; 1.4x the LoRA build on SmolLM2), and mixed precision by sensitivity (the 20% of
# weight MatMuls whose inputs weigh most, by a Hessian estimate, kept at 8 bits: a bigger file).
CANDIDATES.update(
    {
        "openvino_genai_int4_awq_lora_kv_u8": Candidate("openvino_genai", {**_AWQ, "lora_correction": True, **_KV_U8}),
        "openvino_genai_int4_awq_gptq_kv_u8": Candidate(
            "openvino_genai", {**_AWQ, "scale_estimation": False, "gptq": True, **_KV_U8}
        ),
        "openvino_genai_int4_awq_r80_kv_u8": Candidate(
            "openvino_genai", {**_AWQ, "ratio": 0.8, "sensitivity_metric": "hessian_input_activation", **_KV_U8}
        ),
        # GPTQ in place of scale estimation, and the same 20% at INT8 by Hessian.
        "openvino_genai_int4_awq_gptq_r80_kv_u8": Candidate(
            "openvino_genai",
            {
                **_AWQ,
                "scale_estimation": False,
                "gptq": True,
                "ratio": 0.8,
                "sensitivity_metric": "hessian_input_activation",
                **_KV_U8,
            },
        ),
    }
)
# A GGUF source carried through as it is: OpenVINO GenAI on the file's own blocks (nothing quantized
# again), activations in f32 (exact against the dequantized baseline) or INT8 per 32 channels.
CANDIDATES.update(
    {
        "openvino_genai_gguf": Candidate("openvino_genai_gguf"),
        "openvino_genai_gguf_dq32": Candidate("openvino_genai_gguf", {"dynamic_quantization_group_size": 32}),
        # With the u8 KV cache the re-quantized rows serve with (3.4x the sequences per GB of f32).
        "openvino_genai_gguf_kv_u8": Candidate("openvino_genai_gguf", {"kv_cache_precision": "u8"}),
        "openvino_genai_gguf_dq32_kv_u8": Candidate(
            "openvino_genai_gguf", {"dynamic_quantization_group_size": 32, "kv_cache_precision": "u8"}
        ),
        # ONNX Runtime GenAI with the file's blocks in its MatMulNBits weights: f32 activations (exact),
        # or INT8 (accuracy_level 4, the CPU kernel's only fast path for Q8_0's 8-bit weights).
        "ort_genai_gguf": Candidate("onnxruntime_genai_gguf"),
        "ort_genai_gguf_int8": Candidate("onnxruntime_genai_gguf", {"accuracy_level": 4}),
        # The offset types (Q4_1, Q4_K) as 8-bit blocks on a zero-point grid 16 times finer, no added
        # nodes (engine.params.offset_form).
        "ort_genai_gguf_int8_grid": Candidate(
            "onnxruntime_genai_gguf", {"accuracy_level": 4, "offset_form": "int8_grid"}
        ),
        # The layers exact (f32 activations), the 8-bit LM head (SmolLM2's tied Q8_0 embedding) carried
        # as blocks with INT8 activations for that one MatMul: a quarter of the f32 head's bytes a token.
        "ort_genai_gguf_head8": Candidate("onnxruntime_genai_gguf", {"head_accuracy_level": 4}),
        # The file itself in the pipeline's own kernels (x86-64 with AVX2; AVX-512 VNNI where present): its
        # blocks byte for byte, activations at 16 bits (15 on AVX2), one sequence at a time.
        "native_gguf": Candidate("native_gguf"),
    }
)
# The model written as a GGUF file of a type laptop users choose (llama.cpp's file types and per-tensor
# mixes, optimize/export/gguf), gated and served on that exact file: the native kernels where they
# carry every type in it, else OpenVINO GenAI's GGUF reader. The K-quant mixes and Q4_0 are rounded with
# an importance matrix from the calibration text; Q4_K_M without one is there to measure what it buys.
# By name (recipes/recipe/smollm2_laptop.yaml): from a 4-bit source they quantize a quantized model again.
CANDIDATES.update(
    {
        "gguf_q8_0": Candidate("gguf", {"type": "Q8_0"}),
        # The same Q8_0 file in OpenVINO GenAI's reader (exact: u8 blocks of 32, f16 scales), which
        # batches many clients continuously where the native kernels serve one sequence at a time.
        "gguf_q8_0_openvino": Candidate("gguf", {"type": "Q8_0", "serve_with": "openvino_genai_gguf"}),
        "gguf_q6_k": Candidate("gguf", {"type": "Q6_K"}),
        "gguf_q5_k_m": Candidate("gguf", {"type": "Q5_K_M"}),
        "gguf_q4_k_m": Candidate("gguf", {"type": "Q4_K_M"}),
        "gguf_q4_k_m_no_imatrix": Candidate("gguf", {"type": "Q4_K_M", "imatrix": False}),
        "gguf_q4_0": Candidate("gguf", {"type": "Q4_0", "imatrix": False}),
    }
)
# What the race adds to the default set when the source is a GGUF file: the OpenVINO GenAI rows with
# the u8 KV cache, as the re-quantized defaults (the f32-cache rows, exact to the dequantized file, by
# name), and ONNX Runtime GenAI on the file's blocks with INT8 activations in every layer, the offset
# types on the 8-bit grid: on SmolLM2's Q4_1 file +0.1% perplexity against ort_genai_gguf_int8's
# +0.4% (4-bit blocks on their nearest zero points, the rest of each offset as added nodes), level to
# 1.18x its decode speed depending on the hour on a 2-core Zen 4, 262 MB on disk against 223. int8,
# head8 and the exact ort_genai_gguf stay by name. The native kernels decode one sequence fastest of
# all on SmolLM2's Q4_1 file (1.3x llama-bench tg64 on an AMX Xeon, perplexity +0.003%) and batch none:
# what the race ships for one client (not built on a CPU without AVX2, which the outcome says).
DEFAULT_GGUF = [
    "openvino_genai_gguf_kv_u8",
    "openvino_genai_gguf_dq32_kv_u8",
    "ort_genai_gguf_int8_grid",
    "native_gguf",
]
# What the race builds when the recipe names no candidates: decoders for a task that generates
# (a causal LM), graph engines for every other. The OpenVINO GenAI rows serve with the u8 KV cache
# the shipped engine config uses, so the race times and ships what the engine config would build.
# AWQ at group 64 with 20% of the layers at INT8 by Hessian sensitivity took the place of all-INT4 AWQ
# at group 64: SmolLM2 +10.4% perplexity against +15.4%, and the lower served cost of the two.
DEFAULT_GENERATING = [
    "ort_genai_int4_k_quant_mixed",
    "openvino_genai_int4_awq_r80_kv_u8",
    "openvino_genai_int4_g32_awq_kv_u8",
    "openvino_genai_int8_kv_u8",
]
DEFAULT_TENSORS = [
    "ort_fp32",
    "ort_int8_dynamic",
    "ort_int8_qattention",
    "ort_int8_dynamic_all",
    "openvino_f32",
    "openvino_bf16",
    "openvino_int8",
    "openvino_mixed",
]


# A candidate's build budget when the recipe sets none: this many seconds per 100M parameters (embedding
# included: a large vocabulary lengthens every export and every calibration pass), at least the minimum.
# The one race-wide 300 s this replaces built SmolLM2-135M's four LM candidates, and one of a 262k-token
# vocabulary model's (about 270M parameters), whose builds each took several times longer.
BUDGET_S_PER_100M_PARAMS = 120.0
MIN_CANDIDATE_BUDGET_S = 150.0


# The timing phase's budget when the recipe sets none, as a multiple of the longest candidate build
# budget: on a quiet machine MiniLM's race times its 9 runners at both points in about a minute and a
# 110M encoder's in about three, so only a busy machine's retimes come near it.
TIMING_BUDGET_FACTOR = 2.0


def scaled_budget_s(model) -> float:
    """The default build budget of one candidate for this model (an ONNX graph counts its weights)."""
    return max(MIN_CANDIDATE_BUDGET_S, BUDGET_S_PER_100M_PARAMS * parameter_count(model) / 1e8)


def parameter_count(model) -> int:
    if getattr(model, "module", None) is not None and hasattr(model.module, "parameters"):
        return sum(p.numel() for p in model.module.parameters())
    if getattr(model, "onnx_path", None) is not None:
        import numpy as np
        import onnx

        graph = onnx.load(str(model.onnx_path), load_external_data=False).graph
        return sum(int(np.prod(i.dims)) for i in graph.initializer)
    return 0


# From a full-precision source the mixed INT4 row rounds by GPTQ instead of AWQ + scale estimation:
# on SmolLM2 made full precision by a residual rotation (docs/figures-history.md), +6.4% perplexity against
# +22.7% (AWQ + scale estimation alone +29.0%), for about twice the build time. From a GGUF source
# (a re-quantization of 4-bit weights) GPTQ measured no better (+11.6% against +10.4%).
FULL_PRECISION_ROWS = {"openvino_genai_int4_awq_r80_kv_u8": "openvino_genai_int4_awq_gptq_r80_kv_u8"}


# At the sizes where the default race keeps only its cheapest builds (above 0.6B parameters,
# optimize/memory/plan.py's CANDIDATES_BY_SIZE), a causal LM from a full-precision source also races
# the GGUF files the writer streams from the memory-mapped model (optimize/export/gguf/writer.py):
# their builder holds a block of rows in FP32, not the model, so they are the leanest builds there and
# the cut keeps them first, Q4_K_M before Q8_0 where only one fits the count. The Q8_0 file is also
# raced in OpenVINO GenAI (continuous batching for many clients): at 1B parameters the export of the
# OpenVINO INT8 row from an FP32 copy peaked at 6.8 GB (6.35 bytes a parameter), more than the bf16
# checkpoint twice over, where the file's reader needs its blocks. Below that size the default set is
# as it was (SmolLM2's race, winner and figures unchanged).
AT_SIZE_GGUF = ["gguf_q4_k_m", "gguf_q8_0", "gguf_q8_0_openvino"]


def default_candidates(generates: bool, gguf: bool = False, parameters: int = 0) -> list[str]:
    """The default set for a model of `parameters` (0: any size the whole set races at); a causal LM
    from a GGUF file also gets the candidates that keep its blocks, one from a full-precision source
    its GPTQ rows and, at size, the streamed GGUF files (AT_SIZE_GGUF)."""
    from optimize.memory.plan import candidate_limit

    if not generates:
        return list(DEFAULT_TENSORS)
    if gguf:
        return DEFAULT_GGUF + DEFAULT_GENERATING
    names = [FULL_PRECISION_ROWS.get(name, name) for name in DEFAULT_GENERATING]
    return names + AT_SIZE_GGUF if candidate_limit(parameters) is not None else names


@dataclass
class EngineRaceConfig:
    """Example recipe (add static INT8 to the default set, five minutes at most):

    engine:
      method: auto
      params: {candidates: [ort_fp32, ort_int8_dynamic, ort_int8_static, openvino_bf16, openvino_int8],
               time_budget_s: 300}
    """

    candidates: List[str] = field(default_factory=list)  # empty: the model task's default set
    # Parameters merged into a candidate's methods, by candidate name:
    # {openvino_int8: {engine: {smooth_quant_alpha: 0.5}}, ort_int8_dynamic: {quantize: {max_fp32_nodes: 4}}}
    candidate_params: Dict[str, Any] = field(default_factory=dict)
    # Building stops when the race's budget is spent; candidates not built are recorded and the report
    # says so before the winner. null: the sum of the candidates' budgets (candidate_budget_s).
    time_budget_s: Optional[float] = None
    # Seconds each candidate's build may take, by name ("default" for the rest). null: scaled by the
    # model (BUDGET_S_PER_100M_PARAMS, at least MIN_CANDIDATE_BUDGET_S): a 262k-token vocabulary
    # makes every build of a small model several times longer.
    candidate_budget_s: Dict[str, float] = field(default_factory=dict)
    timing_repeats: int = 16  # timed calls per candidate and batch size (fewer when slow)
    # Seconds to time every built candidate at every workload point (encoders). Past them a point is
    # no longer timed again while the machine is busy, and each point left gets its one run with the
    # fewest repeats. null: TIMING_BUDGET_FACTOR times the longest candidate build budget.
    timing_budget_s: Optional[float] = None
    cache: bool = True  # reuse candidates built before with the same content hash

    def validate(self):
        unknown = [c for c in self.candidates if c not in CANDIDATES]
        if unknown:
            raise RecipeError(
                f"engine.params.candidates={self.candidates}: unknown {unknown} (known: {', '.join(CANDIDATES)})"
            )
        stray = set(self.candidate_params) - set(self.candidates or CANDIDATES)
        if stray:
            raise RecipeError(f"engine.params.candidate_params names {sorted(stray)}, which are not candidates")
        for name, params in self.candidate_params.items():
            if not isinstance(params, dict) or set(params) - {"engine", "quantize"}:
                raise RecipeError(f"engine.params.candidate_params.{name} takes engine: and quantize: sections")
        budgets = (self.time_budget_s, self.timing_budget_s)
        if any(b is not None and (not isinstance(b, (int, float)) or b <= 0) for b in budgets):
            raise RecipeError("engine.params.time_budget_s and timing_budget_s must be positive numbers of seconds")
        if self.timing_repeats < 1:
            raise RecipeError("engine.params.timing_repeats must be positive")
        stray = set(self.candidate_budget_s) - set(self.candidates or CANDIDATES) - {"default"}
        if stray:
            raise RecipeError(f"engine.params.candidate_budget_s names {sorted(stray)}, which are not candidates")
        if any(not isinstance(v, (int, float)) or v <= 0 for v in self.candidate_budget_s.values()):
            raise RecipeError("engine.params.candidate_budget_s: every budget must be a positive number of seconds")

    def budget_of(self, name: str, model) -> float:
        """Seconds candidate `name` may take: the recipe's, else scaled by the model's size."""
        given = self.candidate_budget_s.get(name, self.candidate_budget_s.get("default"))
        return float(given) if given is not None else scaled_budget_s(model)

    def spec(self, name: str) -> Candidate:
        base, extra = CANDIDATES[name], self.candidate_params.get(name) or {}
        return Candidate(
            base.engine,
            {**base.engine_params, **(extra.get("engine") or {})},
            base.quantize,
            {**base.quantize_params, **(extra.get("quantize") or {})},
        )
