"""Publishing an artifact to a model registry: MLflow (mlflow_registry.py) or the Hugging Face Hub
(hf_hub.py), from `python -m optimize.publish ARTIFACT --to NAME` or `publish=NAME` at the end of a run.

Before anything is sent: the artifact must be intact (the checker optimize.verify and serve/ use: its
manifest's digest and signature, every file's sha256; with --require-signature a signature by the
key), its gate must have passed unless allow_failed (it is then tagged failed), and the target must be
reachable. Any of those failing is one RecipeError
line (exit 2) and nothing is published.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from optimize.errors import RecipeError

# target name -> module (in this package) with `check(settings)` and `publish(root, manifest, settings) -> str`
TARGETS = {"mlflow": "mlflow_registry", "hf_hub": "hf_hub"}
NONE = "none"


def target(name: str):
    if name not in TARGETS:
        raise RecipeError(f"publish.to={name}: no such registry (use {', '.join([NONE, *TARGETS])})")
    return importlib.import_module(f"{__name__}.{TARGETS[name]}")


def settings_of(cfg_publish: Any) -> dict:
    """The publish section as a plain dict (a recipe node or a dict)."""
    from optimize.config import recipe_dict

    return dict(cfg_publish) if isinstance(cfg_publish, dict) else recipe_dict(cfg_publish)


def one_line(message: object) -> str:
    """A message as one line: values from outside (a repo id, a path, a library's error) may hold
    line breaks."""
    return " ".join(str(message).splitlines())


def check_settings(cfg_publish: Any) -> None:
    """What can be checked before a run: the target exists and its settings are complete."""
    settings = settings_of(cfg_publish)
    if settings.get("to", NONE) == NONE:
        return
    try:
        target(settings["to"]).check_settings(settings)
    except RecipeError as exc:
        raise RecipeError(one_line(exc)) from None


def checked_artifact(
    root: str | Path, allow_failed: bool, key_file: str | None = None, require_signature: bool = False
) -> tuple[dict, str]:
    """The artifact's manifest once the artifact is intact and publishable, and what its signature
    says; else one RecipeError.

    The signature rule is optimize.verify's and serve's: with a key (`key_file`, else the file
    ARTIFACT_VERIFY_KEY names) a signed manifest must match it; an unsigned one is published and
    reported (and tagged) unsigned unless `require_signature`, which refuses it, and refuses any
    manifest when there is no key to check it with."""
    from engines.artifact import VERIFY_KEY_ENV, ArtifactError, check_signature, read_key, read_manifest, verify

    try:
        key_file = key_file or os.environ.get(VERIFY_KEY_ENV)
        key = read_key(key_file) if key_file else None
        manifest = read_manifest(root)
        signature = check_signature(manifest, key, require_signature)
        problems = verify(root, key, require_signature)
    except ArtifactError as exc:
        raise RecipeError(f"{root}: {exc}") from None
    except OSError as exc:
        raise RecipeError(f"{root}: {exc.strerror or exc}") from None
    if problems:
        raise RecipeError(
            f"{root} does not match its manifest ({'; '.join(problems[:3])}"
            f"{'; ...' if len(problems) > 3 else ''}); refusing to publish it"
        )
    check_fields(root, manifest)
    if manifest["verdict"] != "passed" and not allow_failed:
        failed = [c["name"] for c in manifest["gate"]["checks"] if not c["passed"]]
        raise RecipeError(
            f"{root}: the gate failed ({', '.join(failed) or 'verdict ' + str(manifest['verdict'])}); "
            "only passing artifacts are published "
            "(--allow-failed / publish.allow_failed=true publishes it tagged failed)"
        )
    return manifest, signature


def check_fields(root: str | Path, manifest: dict) -> None:
    """The fields the registries read that the artifact checker leaves unchecked: a manifest edited
    and digested again can hold anything there (refused in one line, not a traceback halfway)."""
    wanted = {
        "verdict": str,
        "id": str,
        "created": str,
        "recipe": dict,
        "recipe.name": str,
        "recipe.resolved": dict,
        "model": dict,
        "model.source": str,
        "metrics": dict,
        "gate.checks": list,
    }
    for dotted, kind in wanted.items():
        value: Any = manifest
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if not isinstance(value, kind):
            raise RecipeError(f"{root}: manifest field {dotted} is not a {kind.__name__}; refusing to publish it")
    if not isinstance(manifest.get("evaluation") or {}, dict):
        raise RecipeError(f"{root}: manifest field evaluation is not a dict; refusing to publish it")
    for i, check in enumerate(manifest["gate"]["checks"]):
        if not (
            isinstance(check, dict)
            and isinstance(check.get("name"), str)
            and isinstance(check.get("passed"), bool)
            and all(_number(check.get(k)) or check.get(k) is None for k in ("value", "threshold"))
        ):
            raise RecipeError(f"{root}: manifest field gate.checks[{i}] is malformed; refusing to publish it")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def publish(root: str | Path, settings: dict) -> str:
    """Check, then publish. Returns one line saying where the artifact went (and its signature)."""
    try:
        module = target(settings.get("to", NONE))
        module.check_settings(settings)
        root = Path(root).expanduser().resolve()
        manifest, signature = checked_artifact(
            root, bool(settings.get("allow_failed")), settings.get("key"), bool(settings.get("require_signature"))
        )
        where = module.publish(root, manifest, {**settings, "signature": signature})
    except RecipeError as exc:
        raise RecipeError(one_line(exc)) from None
    return f"{where}; manifest {signature}"


def tags(manifest: dict) -> dict[str, str]:
    """What every registry records about an artifact (MLflow version tags, the Hub card's tags)."""
    engine = manifest.get("engine") or {}
    return {
        "verdict": str(manifest["verdict"]),
        "manifest_id": str(manifest["id"]),
        "parent_id": str(manifest.get("parent_id")),
        "manifest_digest": str(manifest["integrity"]["digest"]),
        "recipe": str(manifest["recipe"]["name"]),
        "engine": str(engine.get("format")),
        "precision": str(engine.get("precision")),
        "device": device(engine),
        "task": str(engine.get("task") or manifest["model"].get("task")),
    }


def device(engine: dict) -> str:
    """gpu when the engine runs on a CUDA provider or device, else cpu."""
    providers = " ".join(engine.get("providers") or []).lower()
    on_gpu = "cuda" in providers or "tensorrt" in providers or str(engine.get("device", "")).startswith("cuda")
    return "gpu" if on_gpu else "cpu"


def model_name(manifest: dict, settings: dict) -> str:
    return settings.get("model_name") or manifest["recipe"]["name"]
