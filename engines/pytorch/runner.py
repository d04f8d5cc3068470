"""PyTorch engine: the baseline every candidate is measured against.

A causal LM whose checkpoint is bf16 or fp16 stays in that precision, memory-mapped from its
safetensors (an FP32 copy of an 8B model is 32 GB); its log-probabilities are still computed in FP32,
each module's weights upcast for its own forward only (fp32_compute), so the scores the gate compares
are those of the FP32 model, bit for bit. Generation (the baseline's timing and sample) runs in the
checkpoint's precision, as transformers runs such a checkpoint, and so may the standard tasks' answers
where this CPU computes that precision faster (TorchLM.scored_in, engines/pytorch/half_compute.py).

Also holds the task wrappers that give a Hugging Face model the named-array interface of a Runner;
the ONNX exporter exports these same wrappers, so baseline and candidate compute the same thing.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from engines.pytorch.half_compute import held_precision
from engines.weights import WeightBytes

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
ENCODER_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


def read_pooling(model_dir: Path) -> dict:
    """Pooling of a sentence-transformers folder: {'mode': 'mean'|'cls', 'normalize': bool}."""
    pooling = {"mode": "mean", "normalize": False}
    config = model_dir / "1_Pooling" / "config.json"
    if config.is_file():
        settings = json.loads(config.read_text())
        if settings.get("pooling_mode_cls_token"):
            pooling["mode"] = "cls"
    modules = model_dir / "modules.json"
    if modules.is_file():
        types = [m.get("type", "") for m in json.loads(modules.read_text())]
        pooling["normalize"] = any(t.endswith("Normalize") for t in types)
    return pooling


def sentence_embedding_module(model, pooling: dict):
    """Wrap an encoder so it returns last_hidden_state and the pooled sentence embedding."""
    import torch

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            if pooling["mode"] == "cls":
                pooled = hidden[:, 0]
            else:  # mean over real tokens only: padding must not dilute the embedding
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            if pooling["normalize"]:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return hidden, pooled

    return SentenceEmbedding().eval()


def logits_module(model):
    """Wrap a Hugging Face classifier (sequence or token) so it takes the encoder's three inputs
    positionally and returns its logits; segment ids go only to a model whose forward takes them."""
    import inspect

    import torch

    takes_segments = "token_type_ids" in inspect.signature(model.forward).parameters

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            segments = {"token_type_ids": token_type_ids} if takes_segments else {}
            return self.classifier(input_ids=input_ids, attention_mask=attention_mask, **segments).logits

    return Logits().eval()


@dataclass(frozen=True)
class HFTask:
    """What the engines need to know of a task whose models are Hugging Face ones."""

    auto_class: str  # the transformers Auto class that loads its models
    # The baseline runner from an engine block: (model, engine block, model folder) -> a module whose
    # forward takes ENCODER_INPUTS and returns `outputs`; None: the task runs its own (TorchLM).
    wrap: Callable[[Any, dict, Path], Any] | None = None
    outputs: tuple[str, ...] = ()


def _pooled(model, engine: dict, model_dir: Path):
    return sentence_embedding_module(model, engine.get("pooling") or read_pooling(model_dir))


def _logits(model, engine: dict, model_dir: Path):
    return logits_module(model)


# The tasks a hub id or a model folder can be given for.
HF_TASKS = {
    "sentence_embedding": HFTask("AutoModel", _pooled, ("last_hidden_state", "sentence_embedding")),
    "causal_lm": HFTask("AutoModelForCausalLM"),
    "text_classification": HFTask("AutoModelForSequenceClassification", _logits, ("logits",)),
    "token_classification": HFTask("AutoModelForTokenClassification", _logits, ("logits",)),
}


class TorchRunner:
    """Calls a module whose forward takes the named inputs positionally and returns a tuple."""

    def __init__(self, module, input_names: list[str], output_names: list[str], threads: int = 0):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.module = module.eval()
        self.input_names = list(input_names)
        self.output_names = list(output_names)

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        args = [torch.from_numpy(np.ascontiguousarray(inputs[n])) for n in self.input_names]
        with torch.inference_mode():
            outputs = self.module(*args)
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        return {n: o.float().numpy() for n, o in zip(self.output_names, outputs)}


# safetensors dtype names -> torch dtype names, for the precisions a baseline is kept in.
HALF_PRECISIONS = {"BF16": "bfloat16", "F16": "float16"}
MAX_SAFETENSORS_HEADER = 100 << 20


def safetensors_dtypes(folder: Path) -> set[str]:
    """The dtypes of the floating tensors in a folder's *.safetensors files, from their headers only
    (an 8-byte length, then JSON); empty when there are none or a header is unreadable."""
    found: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= MAX_SAFETENSORS_HEADER:
                    return set()
                header = json.loads(f.read(size))
        except (OSError, ValueError):
            return set()
        dtypes = {str(t.get("dtype", "")) for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)}
        found |= {d for d in dtypes if d.startswith("F") or d == "BF16"}  # F64..F8_*, BF16; not BOOL or ints
    return found


def source_precision(folder: Path | None) -> str:
    """The torch dtype name a causal LM's baseline is held in: the checkpoint's own where every
    floating tensor is bf16 (or every one fp16), else float32 (a hub id, mixed or FP32 weights)."""
    if folder is None or not folder.is_dir():
        return "float32"
    dtypes = safetensors_dtypes(folder)
    if len(dtypes) == 1 and next(iter(dtypes)) in HALF_PRECISIONS:
        return HALF_PRECISIONS[next(iter(dtypes))]
    return "float32"


def load_hf_model(
    source: str,
    task: str,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    revision: str | None = None,
    gguf_file: str | None = None,
    precision: str = "float32",
):
    """Load a Hugging Face model from a hub id or a local folder (safetensors unless opted in), in
    `precision` (a torch dtype name): a checkpoint already in it is memory-mapped, not copied."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # keep stderr for messages a user must read
    auto = getattr(transformers, HF_TASKS[task].auto_class)
    # Mismatched shapes are listed in the loading info (check_loaded refuses them, naming the weights)
    # rather than raised by transformers as a RuntimeError pointing at a logged table.
    kwargs = dict(
        dtype=getattr(torch, precision),
        trust_remote_code=trust_remote_code,
        revision=revision,
        ignore_mismatched_sizes=True,
    )
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    else:
        kwargs["use_safetensors"] = None if allow_pickle else True
    # SDPA is PyTorch's fastest CPU attention: an eager-attention baseline would inflate speedups.
    # Eager only where transformers has no SDPA path for the architecture (Gemma 2: soft-capping).
    try:
        model, info = auto.from_pretrained(source, **kwargs, attn_implementation="sdpa", output_loading_info=True)
    except ValueError as exc:
        if "scaled_dot_product_attention" not in str(exc):
            raise
        model, info = auto.from_pretrained(source, **kwargs, attn_implementation="eager", output_loading_info=True)
    check_loaded(info)
    return model.eval()


class IncompleteWeights(ValueError):
    """The checkpoint does not hold exactly the model's weights (transformers would initialize the
    missing ones at random and drop the unexpected ones, with only a table on stderr)."""


def check_loaded(info: dict) -> None:
    """Refuse a load whose loading info names missing, unexpected or mismatched weights, or errors."""
    parts = []
    for key, words in (
        ("missing_keys", "missing"),
        ("unexpected_keys", "unexpected"),
        ("mismatched_keys", "of another shape"),
    ):
        names = sorted(str(n[0] if isinstance(n, tuple) else n) for n in info.get(key) or ())
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{len(names)} {words} ({shown})")
    errors = [" ".join(str(e).split())[:200] for e in info.get("error_msgs") or ()]
    if errors:
        parts.append(f"errors: {errors[0]}")
    if parts:
        raise IncompleteWeights("its weights do not match the model: " + "; ".join(parts))


def load_pytorch_runner(root: Path, engine: dict, threads: int = 0, spinning: bool = True) -> TorchRunner:
    """Baseline Runner from an engine block: {'format': 'pytorch', 'model_dir', 'task', ...}."""
    model_dir = Path(engine["model_dir"])
    if not model_dir.is_absolute():
        model_dir = root / model_dir
    task = engine["task"]
    hf_task = HF_TASKS.get(task)
    if hf_task is None or hf_task.wrap is None:
        raise ValueError(f"no PyTorch runner for task {task!r}")
    model = load_hf_model(
        str(model_dir), task, allow_pickle=engine.get("allow_pickle", False), gguf_file=engine.get("gguf_file")
    )
    return TorchRunner(hf_task.wrap(model, engine, model_dir), ENCODER_INPUTS, list(hf_task.outputs), threads)


class TorchLM:
    """A Hugging Face causal LM behind the same scoring and timing calls as GenAIRunner."""

    input_names = ["input_ids"]
    output_names = ["logits"]

    def __init__(self, model, threads: int = 0):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = model.eval()
        self.scores_in = "float32"  # what logits are computed in: FP32 unless scored_in says otherwise

    @contextlib.contextmanager
    def scored_in(self, precision: str):
        """Within it, scores are computed in `precision`: 'float32' (the default, exact) or the one the
        weights are held in (engines/pytorch/half_compute.py says when that pays)."""
        if precision not in ("float32", held_precision(self.model)):
            raise ValueError(f"a model held in {held_precision(self.model)} cannot be scored in {precision}")
        before, self.scores_in = self.scores_in, precision
        try:
            yield
        finally:
            self.scores_in = before

    def _scoring(self):
        """fp32_compute while scores are FP32; nothing while they are in the held precision."""
        return fp32_compute(self.model) if self.scores_in == "float32" else contextlib.nullcontext()

    def release_weight_pages(self) -> int:
        """Give back the resident pages of memory-mapped weights while the model idles; the next
        forward reads them again (engines/pytorch/weight_pages.py). Returns the bytes given back."""
        from engines.pytorch.weight_pages import release

        return release(self.model)

    def weight_bytes_per_token(self):
        """Bytes of parameters read per generated token (an untied embedding: one row per token)."""

        return torch_weight_bytes(self.model)

    def kv_shape(self):
        """Layers, KV heads, head size from the model's config; KV element bytes from its parameters."""
        from engines.weights import kv_shape_from_hf_config

        return kv_shape_from_hf_config(self.model.config.to_dict(), next(self.model.parameters()).element_size())

    def logits(self, ids) -> np.ndarray:
        """FP32 logits, whatever precision the weights are held in (fp32_compute; see scored_in)."""
        import torch

        with torch.inference_mode(), self._scoring():
            out = self.model(input_ids=torch.as_tensor(np.asarray(ids, dtype=np.int64))[None], use_cache=False)
        return out.logits[0].float().numpy()

    def log_likelihood(self, ids, start: int = 1) -> np.ndarray:
        from engines.generation import token_logprobs

        return token_logprobs(self.logits(ids), ids)[start - 1 :]

    def continuation_logprobs(self, context, continuations) -> list[np.ndarray]:
        """log p(each continuation's tokens | context + its earlier tokens), one array per continuation:
        what log_likelihood(context + continuation, start=len(context)) gives, with the shared context
        run once (its KV cache repeated for every continuation) instead of once per continuation. A
        multiple-choice item's choices share their question: 2-3x fewer tokens through the model on
        ARC or HellaSwag. The continuations are right-padded into one batch; causal attention keeps a
        real token from seeing the padding after it, so no mask is needed."""
        import torch

        from engines.generation import padded_continuations

        batch = torch.from_numpy(padded_continuations(context, continuations))
        with torch.inference_mode(), self._scoring():
            context_ids = torch.as_tensor(np.asarray(context, dtype=np.int64))[None]
            # Only the context's last position predicts a continuation token: its other positions' logits
            # (the LM head, a fifth of a small model's weights) are not computed where forward() can skip them.
            head = self.model(input_ids=context_ids, use_cache=True, **_last_logits_only(self.model))
            cache = getattr(head, "cache", None) or head.past_key_values  # the field's name before 5.x
            cache.batch_repeat_interleave(len(continuations))
            tail = self.model(input_ids=batch, use_cache=True, **{_cache_argument(self.model): cache})
        # The first token's log-prob comes from the context's last position, the others from the tail's.
        first = head.logits[0, -1:].float().expand(len(continuations), 1, -1)
        logp = torch.log_softmax(torch.cat([first, tail.logits[:, :-1].float()], dim=1).double(), dim=-1)
        picked = logp.gather(-1, batch[..., None])[..., 0].numpy()
        return [picked[row, : len(ids)] for row, ids in enumerate(continuations)]

    def __call__(self, inputs: dict) -> dict:
        return {"logits": np.stack([self.logits(row) for row in inputs["input_ids"]])}

    def timed_stream(self, prompt_ids, new_tokens: int) -> list[float]:
        """Greedy `generate` with its KV cache for exactly new_tokens: perf_counter() at each new token."""
        import torch

        stamps = token_stamps()
        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=stamps,
                pad_token_id=self.model.config.eos_token_id,
            )
        return stamps.times

    def greedy(self, prompt_ids, new_tokens: int) -> list[int]:
        import torch

        ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64))[None]
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.model.config.eos_token_id,
            )
        return out[0, ids.shape[1] :].tolist()


def torch_weight_bytes(model) -> WeightBytes:
    """Parameters of a torch module (each tensor once, tied ones too); an nn.Embedding whose weight
    no other module uses counts one row per token."""
    import torch

    owners: dict[int, list[torch.nn.Module]] = {}
    tensors: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for module_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            key = id(param)
            owners.setdefault(key, []).append(module)
            tensors.setdefault(key, (f"{module_name}.{pname}".strip("."), param))
    per_token = stored = 0
    gathered = []
    for key, (name, param) in tensors.items():
        size = param.numel() * param.element_size()
        stored += size
        if all(isinstance(m, torch.nn.Embedding) for m in owners[key]) and param.dim() >= 1:
            per_token += -(-size // max(param.shape[0], 1))
            gathered.append(name)
        else:
            per_token += size
    return WeightBytes(per_token, stored, sorted(gathered), "torch parameters")


def token_stamps(before_stamp: Callable[[], Any] = lambda: None):
    """A transformers streamer that records perf_counter() at each new token (`before_stamp` runs
    first: a GPU runner synchronises there so the stamp follows the token's kernels)."""
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times, self.prompt_seen = [], False

        def put(self, value):
            if self.prompt_seen:  # the first put is the prompt itself
                before_stamp()
                self.times.append(time.perf_counter())
            self.prompt_seen = True

        def end(self):
            pass

    return Stamps()


def _last_logits_only(model) -> dict:
    """forward()'s argument that computes the logits of the last position only, where it has one."""
    import inspect

    names = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):  # the name from transformers 4.50, and before
        if name in names:
            return {name: 1}
    return {}


def _cache_argument(model) -> str:
    """The name forward() takes a KV cache by: `cache` from transformers 5.x, `past_key_values` before
    (5.x still takes the old name, with a deprecation warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class fp32_compute:
    """Within it, a model held in bf16/fp16 computes in FP32 one module at a time: each module's own
    parameters and floating buffers are upcast just before its forward and the held ones put back
    just after, so at most one module's FP32 copy exists at once (the largest matrix, not the
    model). The upcast is exact, so the outputs are those of the model loaded in FP32. A model
    already in FP32 is left as it is (no hooks).

    The FP32 copies are made into buffers kept for the context's life, one per shape in use, so a
    forward of 16 alike layers allocates each shape once: a fresh allocation per module made the
    kernel fault in and zero 4 GB a pass of a 1B model, a quarter of the time a short pass (a
    multiple-choice question) took."""

    def __init__(self, model):
        self.model = model
        self.hooks: list = []
        self.spare: dict[tuple, list] = {}  # FP32 buffers no module holds now, by shape

    def __enter__(self):
        import torch

        first = next(self.model.parameters(), None)
        if first is None or first.dtype == torch.float32:
            return self
        for module in self.model.modules():
            if any(t.is_floating_point() for t in _own_tensors(module)):
                self.hooks.append(module.register_forward_pre_hook(self._upcast))
                self.hooks.append(module.register_forward_hook(self._restore, always_call=True))
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()
        self.spare.clear()

    def _fp32(self, tensor):
        """An FP32 copy of `tensor` in a spare buffer of its shape (a new one when none is free)."""
        import torch

        free = self.spare.get(tuple(tensor.shape))
        buffer = free.pop() if free else torch.empty(tensor.shape, dtype=torch.float32)
        return buffer.copy_(tensor)

    def _upcast(self, module, args):
        import torch

        held = {}
        for name, tensor in _own_named(module).items():
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                held[name] = tensor.data
                tensor.data = self._fp32(tensor.data)
        module._held_precision = held
        cast = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        return tuple(cast)

    def _restore(self, module, args, output):
        held = getattr(module, "_held_precision", None) or {}
        tensors = _own_named(module)
        for name, data in held.items():
            self.spare.setdefault(tuple(data.shape), []).append(tensors[name].data)
            tensors[name].data = data
        module._held_precision = {}


def _own_tensors(module) -> list:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _own_named(module) -> dict:
    """The module's own parameters and buffers by name (not its children's)."""
    return dict([*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)])
