"""Publishing an artifact to a model registry: MLflow (mlflow_registry.py) or the Hugging Face Hub
(hf_hub.py), from `python -m optimize.publish ARTIFACT --to NAME` or `publish=NAME` at the end of a run.

Before anything is sent: the artifact must be intact (the checker optimize.verify and serve/ use: its
manifest's digest and signature, every file's sha256), its gate must have passed unless allow_failed
(it is then tagged failed), and the target must be reachable. Any of those failing is one RecipeError
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


def check_settings(cfg_publish: Any) -> None:
    """What can be checked before a run: the target exists and its settings are complete."""
    settings = settings_of(cfg_publish)
    if settings.get("to", NONE) == NONE:
        return
    target(settings["to"]).check_settings(settings)


def checked_artifact(root: str | Path, allow_failed: bool) -> dict:
    """The artifact's manifest once the artifact is intact and publishable; else one RecipeError."""
    from engines.artifact import VERIFY_KEY_ENV, ArtifactError, read_key, read_manifest, verify

    try:
        key_file = os.environ.get(VERIFY_KEY_ENV)
        key = read_key(key_file) if key_file else None
        manifest = read_manifest(root)
        problems = verify(root, key)
    except ArtifactError as exc:
        raise RecipeError(f"{root}: {exc}") from None
    except OSError as exc:
        raise RecipeError(f"{root}: {exc.strerror or exc}") from None
    if problems:
        raise RecipeError(
            f"{root} does not match its manifest ({'; '.join(problems[:3])}"
            f"{'; ...' if len(problems) > 3 else ''}); refusing to publish it"
        )
    if manifest["verdict"] != "passed" and not allow_failed:
        failed = [c["name"] for c in manifest["gate"]["checks"] if not c["passed"]]
        raise RecipeError(
            f"{root}: the gate failed ({', '.join(failed) or 'verdict ' + str(manifest['verdict'])}); "
            "only passing artifacts are published "
            "(--allow-failed / publish.allow_failed=true publishes it tagged failed)"
        )
    return manifest


def publish(root: str | Path, settings: dict) -> str:
    """Check, then publish. Returns one line saying where the artifact went."""
    module = target(settings.get("to", NONE))
    module.check_settings(settings)
    root = Path(root).expanduser().resolve()
    manifest = checked_artifact(root, bool(settings.get("allow_failed")))
    return module.publish(root, manifest, settings)


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
