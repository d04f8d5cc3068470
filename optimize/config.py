"""The recipe schema. Hydra composes YAML from recipes/ onto these dataclasses, so an unknown or
mistyped key fails at composition time with the key's name, before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


@dataclass
class InputSpec:
    """One model input as a recipe sets it (`model.inputs.NAME`): what random and constant tensors
    look like, and the concrete values of the graph's symbolic dims (a string dim is the batch)."""

    shape: Optional[List[Any]] = None  # e.g. [N, 3, 640, 640]; null: the model's, symbolic dims resolved
    dtype: Optional[str] = None  # float32 | float16 | int64 | int32 | uint8 | bool; null: the model's
    value: Optional[float] = None  # a constant input (a sample rate, a zero state); data never feeds it
    low: Optional[float] = None  # random data: uniform in [low, high) when both are set ...
    high: Optional[float] = None
    mean: float = 0.0  # ... otherwise normal(mean, std)
    std: float = 1.0


@dataclass
class ModelConfig:
    # A Hugging Face hub id, a local folder, a .gguf file, an .onnx file, or pkg://PACKAGE/SUBPATH
    # (a folder shipped inside an installed Python package, found without importing it).
    source: str = MISSING
    # sentence_embedding | causal_lm | generic (any ONNX file: outputs compared tensor by tensor)
    task: str = "sentence_embedding"
    revision: Optional[str] = None
    gguf_file: Optional[str] = None
    tokenizer: Optional[str] = None  # tokenizer folder for an ONNX source that takes token ids
    hub_id: Optional[str] = None  # the model's Hugging Face Hub name when `source` is a local copy (model cards)
    max_length: int = 128
    trust_remote_code: bool = False
    allow_pickle: bool = False  # pickled checkpoints can run code when loaded: opt in explicitly
    # Inputs of a model that takes tensors (an ONNX file without a tokenizer): shapes, dtypes and
    # value ranges by input name, for random data, constant inputs and the graph's symbolic dims.
    # Each entry takes InputSpec's keys (checked when the model loads: the names are the model's own).
    inputs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ImageOptions:
    """image_folder: how a picture becomes one input tensor (pixels scaled to 0..1, then (x - mean) / std)."""

    size: Optional[List[int]] = None  # [H, W] each image is resized to (null: as it is; all must match)
    resize: str = "stretch"  # stretch | letterbox (keep the aspect ratio, pad with `pad`)
    tile: bool = False  # cut each image into non-overlapping size[0] x size[1] tiles instead of resizing
    layout: str = "NCHW"  # NCHW | NHWC
    channels: str = "RGB"  # RGB | BGR | L
    mean: List[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    std: List[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    pad: float = 0.0  # letterbox padding, as a pixel value in 0..1
    files: str = "*"  # a glob the folder's image files must match (e.g. "*.png")


@dataclass
class AudioOptions:
    """audio_folder: files decoded to mono, resampled to sample_rate, cut into windows of `samples`."""

    sample_rate: int = 16000
    samples: int = 16000  # window length in samples at sample_rate (one item per window)
    hop: Optional[int] = None  # samples between window starts (null: = samples, no overlap)


@dataclass
class DataConfig:
    source: str = "cpython_docs"  # a registered source in calibration/ (cpython_docs, text_file, jsonl)
    split: str = "calibration"  # calibration | evaluation (disjoint parts of the same source)
    path: Optional[str] = None  # for file sources (pkg://PACKAGE/SUBPATH: shipped inside a package)
    # image_folder and audio_folder: how files become tensors (declared before `field`, which shadows
    # dataclasses.field in this class body).
    image: ImageOptions = field(default_factory=ImageOptions)
    audio: AudioOptions = field(default_factory=AudioOptions)
    field: str = "text"  # jsonl field holding the text
    label_field: Optional[str] = None  # labeled: the column of labels (default "label"); NER: one tag per word
    count: int = 64
    seed: int = 0
    min_chars: int = 200
    dataset_split: Optional[str] = None  # hf_dataset: use this split whole (default: train, divided by hash)
    shape: Optional[List[int]] = None  # random source only: item shape (none: random sentences)


@dataclass
class MethodConfig:
    method: str = "none"
    # Typed by the chosen method's own config dataclass (registry.store_schemas) once its group YAML
    # names its schema; untyped only for `none`.
    params: Any = field(default_factory=dict)


@dataclass
class EvaluateConfig:
    data: DataConfig = field(default_factory=lambda: DataConfig(split="evaluation", count=64, seed=1))
    inputs: str = "data"  # data | random (random tensors shaped from the model signature, on request only)
    batch_sizes: List[int] = field(default_factory=lambda: [1, 32])
    warmup: int = 3
    repeats: int = 30  # timed calls per runner and batch size (fewer when a budget of 20 s would be exceeded)
    # A point timed while other processes took over 10% of the CPUs is timed again, up to this many more
    # times, and the quietest run kept. 0: never (a machine known to be shared, where no speed is gated).
    retimes: int = 2
    top_k: int = 5
    threads: int = 0  # intra-op threads for every runner; 0 = all cores
    memory: bool = True  # peak memory of each runner, measured in a fresh subprocess
    latency: bool = True
    overlap: str = "error"  # calibration/evaluation overlap: error | drop
    task_params: Dict[str, Any] = field(default_factory=dict)  # options of the task's own evaluation


@dataclass
class GateConfig:
    """Thresholds; one left null is not checked."""

    min_cosine: Optional[float] = None
    min_mean_cosine: Optional[float] = None
    min_topk_agreement: Optional[float] = None
    max_abs_error: Optional[float] = None
    min_speedup: Optional[float] = None
    # The batch size min_speedup / max_p95_ms are checked at, or `all` (every point of workload.batches,
    # one check each). Any: OmegaConf takes no Union of int and str; optimize/workload.py checks it.
    speedup_batch_size: Any = 1
    max_p95_ms: Optional[float] = None
    latency_batch_size: Any = 1
    max_size_mb: Optional[float] = None
    max_peak_memory_mb: Optional[float] = None
    max_accuracy_drop: Optional[float] = None  # classifiers: top-1 accuracy drop vs baseline, in points
    min_accuracy: Optional[float] = None  # classifiers: candidate top-1 accuracy (0..1)
    # Labeled classifiers (text_classification: macro-F1; token_classification: entity F1), in points;
    # the report gives each drop's paired bootstrap interval and says when the set cannot resolve it.
    max_f1_drop: Optional[float] = None
    min_prediction_agreement: Optional[float] = None  # share of predictions equal to the baseline's (0..1)
    # Maps (segmentation, text detection) binarized at evaluate.task_params.mask_threshold, vs baseline:
    min_mask_iou: Optional[float] = None  # IoU pooled over the evaluation set (0..1)
    min_mask_agreement: Optional[float] = None  # share of pixels on the same side of the threshold
    max_ppl_increase_pct: Optional[float] = None  # causal LMs: held-out perplexity increase, percent
    # causal LMs: the increase over the source's own run, percent. The baseline is the source as the user
    # brought it (a GGUF file dequantized: its quantized model; a checkpoint in FP32), so a candidate
    # that keeps a GGUF's blocks scores ~0 here and one quantized again scores what it lost.
    max_ppl_increase_over_source_pct: Optional[float] = None
    min_decode_speedup: Optional[float] = None  # causal LMs: decode tokens/s (p50) over PyTorch FP32 greedy
    # The request shape min_decode_speedup is checked at ("1024x128": prompt x output tokens), or `all`
    # (every point of workload.requests); null: the first request of the workload.
    request_shape: Optional[str] = None
    max_lm_eval_drop: Optional[float] = None  # causal LMs: largest lm-eval accuracy drop, in points
    # Causal LMs, served: the real server (python -m serve) started on the candidate on loopback and
    # driven by served_concurrency closed-loop streaming clients; the figures are what the clients saw.
    max_served_ttft_p95_ms: Optional[float] = None  # time to first token, p95 over every request
    min_served_tokens_per_s: Optional[float] = None  # output tokens/s of all clients together
    # Clients at once: a number (one level, checked under the plain names), or all / null: every level
    # of workload.concurrency, one check each (max_served_ttft_p95_ms[concurrency=16]).
    served_concurrency: Any = None
    served_prompt_tokens: Optional[int] = None  # null: the workload's first request shape
    served_output_tokens: Optional[int] = None
    served_requests_per_client: int = 2  # each client sends this many requests, one after another
    # This share (0..1) of the served requests carry a `response_format` json_schema (a small fixed
    # schema, optimize/evaluate/served.py); every constrained reply is parsed and validated, and the
    # check max_served_invalid_structured (null: 0 whenever the share is above 0) counts those that fail.
    served_structured_share: float = 0.0
    max_served_invalid_structured: Optional[int] = None
    # Causal LMs, token-level fidelity to the baseline on held-out prose and code (docs/gate.md):
    max_mean_kld: Optional[float] = None  # mean KL(baseline || candidate) per token, nats
    max_p99_kld: Optional[float] = None  # its 99th percentile over the tokens
    min_top1_agreement: Optional[float] = None  # share of tokens whose argmax is the baseline's (0..1)
    max_rms_delta_p_pct: Optional[float] = None  # RMS change of the correct token's probability, points
    # Causal LMs, standard tasks (evaluate.task_params.standard_tasks): the paired accuracy drop pooled
    # over the tasks' items, in points; fails when its 95% interval is wider than the threshold.
    max_task_drop_pts: Optional[float] = None
    min_distill_recovery: Optional[float] = None  # prune+distill: share of the pruning perplexity loss won back (0..1)


@dataclass
class WorkloadConfig:
    """The traffic the artifact will serve: what the race optimizes and the evaluation times at every
    point. Resolved and checked in optimize/workload.py (Any: OmegaConf takes neither Union nor Literal)."""

    # Encoders and tensor models: {batch size: weight} ({1: 0.7, 32: 0.3}; a weight is the share of
    # calls made at that size) or a list (equal weights). null: the one batch size the gate's speed
    # check names (today's race), timed with evaluate.batch_sizes as before.
    batches: Any = None
    # Causal LMs: [{prompt: 64, output: 64, weight: 0.5}, {prompt: 1024, output: 128, weight: 0.5}]
    # (prompt and output in tokens; weight default 1). null: one request of evaluate.task_params'
    # prompt_tokens and new_tokens.
    requests: Any = None
    # Requests in flight at once: {1: 0.5, 16: 0.5} (clients -> share of the time), a list of levels
    # (equal weights) or one number. null: causal LMs 1 and 16 clients, half each; other tasks 1. The
    # LM race times every passing candidate as served at each level; the served gate checks each.
    concurrency: Any = None


@dataclass
class ServeDefaults:
    """Serving defaults recorded in the artifact; `python -m serve` flags override them."""

    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    max_queue: int = 256
    timeout_s: float = 30.0
    # The artifact must serve constrained output (`response_format` json_object / json_schema, vLLM's
    # `structured_outputs`, forced tool calls): the plan refuses an engine whose format cannot
    # constrain (engines/formats.py), and the race builds only candidates that can.
    structured_output: bool = False


@dataclass
class ReportConfig:
    """Where the CI reports go besides the artifact (which always holds report.md and junit.xml)."""

    junit: Optional[str] = None  # also write the JUnit XML here (where the CI system looks for it)


@dataclass
class PublishConfig:
    """A model registry the artifact goes to at the end of a run (`publish=mlflow`), or with
    `python -m optimize.publish ARTIFACT --to NAME`. Only a gate-passing artifact is published unless
    allow_failed is set (it is then tagged failed). Credentials never go here: they would be recorded
    in the manifest (MLflow reads MLFLOW_TRACKING_TOKEN etc., the Hub HF_TOKEN)."""

    to: str = "none"  # none | mlflow | hf_hub
    allow_failed: bool = False
    # mlflow: default an embedded SQLite store beside the artifact (<artifact>/../mlruns), no server needed
    tracking_uri: Optional[str] = None
    experiment: str = "optimize"
    model_name: Optional[str] = None  # mlflow: the registered model; default: the recipe's name
    # hf_hub: the repository ("owner/name"), the folder the upload is assembled in, and dry_run to list
    # what would be uploaded without any network access
    repo_id: Optional[str] = None
    folder: Optional[str] = None
    private: bool = True
    dry_run: bool = False


@dataclass
class RecipeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    calibration: DataConfig = field(default_factory=DataConfig)
    prune: MethodConfig = field(default_factory=MethodConfig)
    distill: MethodConfig = field(default_factory=MethodConfig)
    quantize: MethodConfig = field(default_factory=MethodConfig)
    engine: MethodConfig = field(default_factory=lambda: MethodConfig(method="onnx"))
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    serve: ServeDefaults = field(default_factory=ServeDefaults)
    report: ReportConfig = field(default_factory=ReportConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    output_dir: Optional[str] = None  # final artifact path; default: <hydra run dir>/artifact
    overwrite: bool = False
    seed: int = 0


def recipe_dict(node) -> dict[str, Any]:
    """A recipe section as a plain dict, interpolations resolved (empty for an empty section)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(node, resolve=True) if node is not None else None
    return {str(k): v for k, v in container.items()} if isinstance(container, dict) else {}


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    from optimize import registry

    ConfigStore.instance().store(name="recipe_schema", node=RecipeConfig)
    registry.store_schemas()
