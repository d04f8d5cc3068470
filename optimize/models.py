"""Resolving and loading the recipe's model source, safely.

Sources: a Hugging Face hub id, a local folder, a .gguf file, an .onnx file, or pkg://PACKAGE/PATH.
Pickled checkpoints are refused unless the recipe opts in (loading a pickle can run code), and
trust_remote_code stays off unless the recipe turns it on.
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.pytorch_runner import PICKLE_SUFFIXES
from optimize.errors import RecipeError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class SourceModel:
    kind: str  # "hf" (a PyTorch module) or "onnx" (a file)
    task: str
    location: str  # resolved path or hub id
    module: Any = None  # the torch model for kind "hf"
    onnx_path: Path | None = None
    tokenizer_dir: Path | None = None
    gguf_file: str | None = None
    info: dict = field(default_factory=dict)


def resolve_package_path(source: str) -> Path:
    """pkg://name/sub/path -> the folder of an installed package joined with sub/path (not imported)."""
    rest = source[len("pkg://"):]
    package, _, sub = rest.partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError(f"model.source={source}: package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / sub


def resolve(cfg) -> tuple[str, Path | None]:
    """Returns (kind, local path or None for a hub id). Checks existence and pickle safety."""
    source = cfg.source
    path = resolve_package_path(source) if source.startswith("pkg://") else Path(source).expanduser()
    if path.exists():
        return _classify_local(path, cfg), path
    looks_local = source.startswith(("pkg://", "/", ".", "~")) or path.suffix in (".onnx", ".gguf", *PICKLE_SUFFIXES)
    if looks_local or not _HUB_ID.match(source):
        raise RecipeError(f"model.source={source}: no such file or directory")
    return "hub", None


def _classify_local(path: Path, cfg) -> str:
    if path.is_file():
        if path.suffix == ".onnx":
            return "onnx"
        if path.suffix == ".gguf":
            return "gguf"
        if path.suffix in PICKLE_SUFFIXES:
            if not cfg.allow_pickle:
                raise RecipeError(f"model.source={path} is a pickled checkpoint, which can run code when loaded; "
                                  "convert it to safetensors or set model.allow_pickle=true if you trust it")
            return "pickle"
        raise RecipeError(f"model.source={path}: unsupported file type {path.suffix or '(none)'}")
    if not (path / "config.json").is_file():
        raise RecipeError(f"model.source={path} is not a Hugging Face model folder (no config.json)")
    if not any(path.glob("*.safetensors")) and not cfg.allow_pickle:
        if any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
            raise RecipeError(f"model.source={path} has only pickled weights; convert them to safetensors "
                              "or set model.allow_pickle=true if you trust them")
        raise RecipeError(f"model.source={path} has no *.safetensors weights")
    return "folder"


def load(cfg) -> SourceModel:
    kind, path = resolve(cfg)
    if kind == "onnx":
        tokenizer = Path(cfg.tokenizer).expanduser() if cfg.tokenizer else None
        if tokenizer and not (tokenizer / "tokenizer.json").is_file():
            raise RecipeError(f"model.tokenizer={cfg.tokenizer} has no tokenizer.json")
        return SourceModel("onnx", cfg.task, str(path), onnx_path=path, tokenizer_dir=tokenizer)
    if cfg.task == "image_classification":  # a small CNN from safetensors + config.json (optimize/vision.py)
        from optimize.vision import load_source

        return load_source(cfg, path)
    if cfg.task not in ("sentence_embedding", "causal_lm"):
        raise RecipeError(f"model.task={cfg.task} needs an ONNX source; Hugging Face models support "
                          "sentence_embedding and causal_lm")
    return _load_hf(cfg, kind, path)


def _load_hf(cfg, kind: str, path: Path | None) -> SourceModel:
    from engines.pytorch_runner import load_hf_model

    location, gguf_file = (cfg.source if path is None else str(path)), cfg.gguf_file
    if kind == "gguf":
        location, gguf_file = str(path.parent), path.name
        if importlib.util.find_spec("gguf") is None:
            raise RecipeError("loading a GGUF file needs the 'gguf' package: pip install gguf accelerate")
    if kind == "pickle":
        raise RecipeError(f"model.source={path}: a bare checkpoint file has no architecture; "
                          "give the Hugging Face folder that holds it")
    try:
        module = load_hf_model(location, cfg.task, allow_pickle=cfg.allow_pickle,
                               trust_remote_code=cfg.trust_remote_code, revision=cfg.revision, gguf_file=gguf_file)
    except OSError as exc:  # transformers reports unreachable hubs and missing files as OSError
        first_line = str(exc).strip().splitlines()[0]
        raise RecipeError(f"model.source={cfg.source}: cannot load ({first_line})") from None
    tokenizer_dir = path if (path is not None and path.is_dir()) else None
    return SourceModel("hf", cfg.task, location, module=module, tokenizer_dir=tokenizer_dir, gguf_file=gguf_file,
                       info={"class": type(module).__name__,
                             "parameters": sum(p.numel() for p in module.parameters())})
