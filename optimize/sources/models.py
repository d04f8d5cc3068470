"""Resolving and loading the recipe's model source, safely.

Sources: a Hugging Face hub id, a local folder, a .gguf file, an .onnx file, or pkg://PACKAGE/PATH.
Pickled checkpoints are refused unless the recipe opts in (loading a pickle can run code), and
trust_remote_code stays off unless the recipe turns it on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
from pathlib import Path

from engines.cache import cache_root
from engines.pytorch.runner import HF_TASKS, PICKLE_SUFFIXES
from optimize import tasks
from optimize.context import SourceModel
from optimize.errors import RecipeError
from optimize.sources.gguf_header import check_gguf_source

log = logging.getLogger(__name__)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_package_path(source: str) -> Path:
    """pkg://name/sub/path -> the folder of an installed package joined with sub/path (not imported)."""
    rest = source[len("pkg://") :]
    package, _, sub = rest.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError(f"model.source={source}: package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / sub


# ONNX operator domains ONNX Runtime's CPU build runs; a graph using any other (a custom op library) cannot load.
KNOWN_ONNX_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "ai.onnx.preview.training"}
MAX_LENGTH_LIMIT = 1 << 20


def resolve(cfg) -> tuple[str, Path | None]:
    """Returns (kind, local path or None for a hub id). Checks existence, file kind and pickle safety."""
    source = cfg.source
    max_length = cfg.get("max_length")
    if max_length is not None and not 1 <= max_length <= MAX_LENGTH_LIMIT:
        raise RecipeError(f"model.max_length={max_length} must be between 1 and the model's position limit")
    path = resolve_package_path(source) if source.startswith("pkg://") else Path(source).expanduser()
    if os.path.lexists(path):
        if path.is_symlink() and path.suffix == ".onnx":
            raise RecipeError(f"model.source={source} is a symbolic link; give the file itself")
        kind = _classify_local(path, cfg)
        if kind == "onnx":
            check_onnx_source(path, source)
        if kind == "gguf":
            check_gguf_source(path, source)
        return kind, path
    looks_local = source.startswith(("pkg://", "/", ".", "~")) or path.suffix in (".onnx", ".gguf", *PICKLE_SUFFIXES)
    if looks_local or not _HUB_ID.match(source):
        raise RecipeError(f"model.source={source}: no such file or directory{_how_to_train(path)}")
    return "hub", None


# Models the project trains itself into the cache (none installs offline), and the command that does.
TRAINED_IN_CACHE = {"classifiers/minilm_docstrings": "python -m optimize.train.classifier"}


def _how_to_train(path: Path) -> str:
    for name, command in TRAINED_IN_CACHE.items():
        if path == cache_root() / name:
            return f" (this model is trained on this machine: run {command} first, a few minutes on 2 cores)"
    return ""


def _classify_local(path: Path, cfg) -> str:
    if path.exists() and not path.is_file() and not path.is_dir():
        from engines.artifact import describe_kind

        raise RecipeError(f"model.source={path} is {describe_kind(os.stat(path).st_mode)}, not a file or folder")
    if path.is_file():
        if path.suffix == ".onnx":
            return "onnx"
        if path.suffix == ".gguf":
            return "gguf"
        if path.suffix in PICKLE_SUFFIXES:
            if not cfg.allow_pickle:
                raise RecipeError(
                    f"model.source={path} is a pickled checkpoint, which can run code when loaded; "
                    "convert it to safetensors or set model.allow_pickle=true if you trust it"
                )
            return "pickle"
        raise RecipeError(f"model.source={path}: unsupported file type {path.suffix or '(none)'}")
    if not (path / "config.json").is_file():
        raise RecipeError(f"model.source={path} is not a Hugging Face model folder (no config.json)")
    if not any(path.glob("*.safetensors")) and not cfg.allow_pickle:
        if any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
            raise RecipeError(
                f"model.source={path} has only pickled weights; convert them to safetensors "
                "or set model.allow_pickle=true if you trust them"
            )
        raise RecipeError(f"model.source={path} has no *.safetensors weights")
    return "folder"


def check_onnx_source(path: Path, source: str) -> None:
    """An ONNX source the pipeline can use, or one RecipeError: a regular single-link file, parseable,
    its external data beside it (checked here, not left to onnx or ONNX Runtime), passing the ONNX
    checker, and using no operator domain ONNX Runtime lacks."""
    from engines.artifact import ArtifactError, check_onnx_external_data, check_regular_file

    try:
        check_regular_file(path, f"model.source={source}")
        check_onnx_external_data(path)
    except ArtifactError as exc:
        text = str(exc)
        raise RecipeError(text if text.startswith("model.source") else f"model.source={source}: {text}") from None
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
        onnx.checker.check_model(str(path))
    except Exception as exc:  # DecodeError, ValidationError: both mean a bad file
        text = " ".join(str(exc).strip().split("\n")[0].split())[:300] or type(exc).__name__
        raise RecipeError(f"model.source={source} is not a valid ONNX model: {text}") from None
    domains = {o.domain for o in model.opset_import} | {n.domain for n in model.graph.node}
    custom = sorted(domains - KNOWN_ONNX_DOMAINS)
    if custom:
        raise RecipeError(
            f"model.source={source} uses operators of the custom domain(s) {', '.join(custom)}, "
            "which ONNX Runtime cannot run without their library"
        )


def check_max_length(cfg, module) -> None:
    """model.max_length within what the model's position embeddings allow."""
    config = getattr(module, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and cfg.max_length > limit:
        raise RecipeError(
            f"model.max_length={cfg.max_length} is more than the {limit} positions this model's "
            "position embeddings allow"
        )


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """One quick TCP connection to the hub (HF_ENDPOINT), instead of the hub client's minute of retries."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection(
            (url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)), timeout_s
        ):
            return True
    except OSError:
        return False


def _go_offline() -> None:
    """Use only the local cache from now on (the environment for libraries not imported yet, the
    constant for those that are)."""
    import sys

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True  # type: ignore[attr-defined]


def load(cfg) -> SourceModel:
    kind, path = resolve(cfg)
    if kind == "onnx":
        tokenizer = Path(cfg.tokenizer).expanduser() if cfg.tokenizer else None
        if tokenizer and not (tokenizer / "tokenizer.json").is_file():
            raise RecipeError(f"model.tokenizer={cfg.tokenizer} has no tokenizer.json")
        return SourceModel("onnx", cfg.task, str(path), onnx_path=path, tokenizer_dir=tokenizer)
    own = tasks.get(cfg.task).load_source(cfg, path)  # tasks whose models are not Hugging Face ones
    if own is not None:
        return own
    if cfg.task not in HF_TASKS:
        raise RecipeError(
            f"model.task={cfg.task} needs an ONNX source; Hugging Face models support {', '.join(HF_TASKS)}"
        )
    return _load_hf(cfg, kind, path)


def _load_hf(cfg, kind: str, path: Path | None) -> SourceModel:
    from engines.pytorch.runner import IncompleteWeights, load_hf_model, source_precision

    location, gguf_file = (cfg.source if path is None else str(path)), cfg.gguf_file
    offline = False
    if kind == "hub" and os.environ.get("HF_HUB_OFFLINE") not in ("1", "true", "True", "YES", "yes"):
        if not hub_reachable():
            _go_offline()
            offline = True
    if kind == "gguf":
        assert path is not None  # a .gguf source is a file
        location, gguf_file = str(path.parent), path.name
        if importlib.util.find_spec("gguf") is None:
            raise RecipeError("loading a GGUF file needs the 'gguf' package: pip install gguf accelerate")
    if kind == "pickle":
        raise RecipeError(
            f"model.source={path}: a bare checkpoint file has no architecture; "
            "give the Hugging Face folder that holds it"
        )
    precision = source_precision(path) if cfg.task == "causal_lm" else "float32"
    if kind == "folder" and precision != "float32":
        shards = len(list(path.glob("*.safetensors"))) if path is not None else 0
        log.info(
            "model.source=%s: %s safetensors (%d file%s): carried in %s, memory-mapped, "
            "scored in FP32 a module at a time",
            cfg.source,
            precision,
            shards,
            "" if shards == 1 else "s",
            precision,
        )
    try:
        if gguf_file:  # the file's FP32 conversion, written a tensor at a time, then memory-mapped
            module = load_hf_model(str(converted_folder(Path(location) / gguf_file)), cfg.task)
        else:
            module = load_hf_model(
                location,
                cfg.task,
                allow_pickle=cfg.allow_pickle,
                trust_remote_code=cfg.trust_remote_code,
                revision=cfg.revision,
                precision=precision,
            )
    except OSError as exc:  # transformers reports unreachable hubs and missing files as OSError
        if offline:
            raise RecipeError(
                f"model.source={cfg.source}: the hub is unreachable and the model is not in the local cache"
            ) from None
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RecipeError(f"model.source={cfg.source}: cannot load ({first_line})") from None
    except IncompleteWeights as exc:  # a missing tensor would be random weights the gate cannot see
        raise RecipeError(f"model.source={cfg.source}: {exc}") from None
    except ValueError as exc:
        if gguf_file and ("GGUF" in str(exc) or "ggml" in str(exc)):  # transformers' GGUF readers refusing
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise RecipeError(f"model.source={cfg.source}: cannot load the GGUF file ({first_line})") from None
        if "trust_remote_code" in str(exc):
            raise RecipeError(
                f"model.source={cfg.source} needs custom code from its repository, which would "
                "run on this machine; set model.trust_remote_code=true only if you trust it"
            ) from None
        raise
    check_max_length(cfg, module)
    tokenizer_dir = path if (path is not None and path.is_dir()) else None
    return SourceModel(
        "hf",
        cfg.task,
        location,
        module=module,
        tokenizer_dir=tokenizer_dir,
        gguf_file=gguf_file,
        info={"class": type(module).__name__, "parameters": sum(p.numel() for p in module.parameters())},
    )


def source_hash(source: SourceModel) -> dict:
    """sha256 of the source's weight files (or the ONNX file), by name."""
    from engines.artifact import check_onnx_external_data, sha256_file

    path = Path(source.location)
    if source.kind == "onnx" and source.onnx_path is not None:  # the graph and its external data files
        files = [source.onnx_path, *check_onnx_external_data(source.onnx_path)]
        return {p.relative_to(source.onnx_path.parent).as_posix(): sha256_file(p) for p in files}
    if source.gguf_file:
        return {source.gguf_file: sha256_file(path / source.gguf_file)}
    if path.is_dir():
        return {p.name: sha256_file(p) for p in sorted(path.glob("*.safetensors"))}
    return {}


# ---------------------------------------------------------------- GGUF -> cached Hugging Face folder


def hf_folder(source) -> Path:
    """A Hugging Face folder (config + safetensors + tokenizer) for builders that read one: a folder
    source as it is, a GGUF source's FP32 conversion (converted_folder)."""
    location = Path(source.location)
    if not source.gguf_file:
        if not (location / "config.json").is_file():
            raise RecipeError(f"model.source={source.location}: the engine needs a local model folder")
        return location
    return converted_folder(location / source.gguf_file)


def converted_folder(gguf_path: Path) -> Path:
    """The GGUF file dequantized to FP32 safetensors, a tensor at a time (optimize/sources/gguf_convert.py),
    under the cache keyed by the file's sha256: written once, reused by later runs only when it
    verifies (optimize/cache_store.py: its files, this code, this GGUF), else rebuilt. The baseline
    memory-maps it and the builders read it, so no process holds the dequantized model in memory."""
    from engines.artifact import sha256_file
    from optimize import cache_store

    digest = sha256_file(gguf_path)
    folder = cache_root() / "gguf" / digest[:24]
    good, why = cache_store.open_verified(folder, "gguf:" + digest)
    if good:
        return folder
    if why != "not cached":
        log.warning("cached conversion of %s under %s not used, rebuilt: %s", gguf_path.name, folder, why)
        cache_store.discard(folder)
    from optimize.sources.gguf_convert import convert
    from optimize.sources.gguf_header import fp32_bytes, read_header

    folder.parent.mkdir(parents=True, exist_ok=True)
    need, free = fp32_bytes(read_header(gguf_path)), shutil.disk_usage(folder.parent).free
    if need > free:
        raise RecipeError(
            f"model.source={gguf_path}: its FP32 conversion needs {need / 2**30:.1f} GiB of disk under "
            f"{folder.parent}, {free / 2**30:.1f} GiB free"
        )
    log.info("converting %s to FP32 safetensors under %s, a tensor at a time (once)", gguf_path.name, folder)
    tmp = cache_store.staging(folder)
    try:
        convert(gguf_path, tmp)
        cache_store.seal(tmp, folder, "gguf:" + digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def dequantized_copy(module):
    """A GGUF-loaded model as a plain one: rebuilt from its config without quantization_config (which
    makes save_pretrained refuse and marks the model quantized to trainers), the dequantized weights
    loaded into it."""
    from transformers import AutoModelForCausalLM

    config = module.config.__class__.from_dict(module.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=module.dtype)
    clean.load_state_dict(module.state_dict())
    return clean


def save_converted(module, location: Path, gguf_file: str, folder: Path, record_source: str) -> None:
    """save_pretrained refuses GGUF-loaded models ("quantized with gguf"): rebuild the model from its
    config without quantization_config, load the dequantized weights, save that (in a staging folder
    of this run, then sealed and renamed into place)."""
    from transformers import AutoTokenizer

    from optimize import cache_store

    log.info("converting %s to safetensors under %s (once)", gguf_file, folder)
    clean = dequantized_copy(module)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache_store.staging(folder)
    try:
        clean.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(str(location), gguf_file=gguf_file).save_pretrained(str(tmp))
        cache_store.seal(tmp, folder, record_source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
