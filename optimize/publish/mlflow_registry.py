"""MLflow: one run per published artifact, and a registered model version pointing at it.

The run holds the recipe as params, the candidate's and baseline's metrics and every gate check as
metrics, and as files the whole artifact (`artifact/`, what the model version points at) plus the
manifest, the reports and the plots at the top for the UI. The version is tagged with the verdict, the
manifest id and digest, the parent id, the engine, its precision and the device.

Tracking URI: `publish.tracking_uri` / `--tracking-uri`, else an embedded SQLite store beside the
artifact (`mlruns/mlflow.db`, files under `mlruns/artifacts/`), which needs no server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from optimize.ci_report import JUNIT_XML, REPORT_MD, plots
from optimize.errors import RecipeError
from optimize.publish import model_name, tags

STORE_DIR, STORE_DB = "mlruns", "mlflow.db"
PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value
BATCH = 100  # params per log_batch call (MLflow takes at most 100 params in one batch)
HEALTH_TIMEOUT_S = 5


def check_settings(settings: dict) -> None:
    if settings.get("tracking_uri"):
        check_reachable(settings["tracking_uri"])


def tracking_uri(root: Path, settings: dict) -> str:
    return settings.get("tracking_uri") or f"sqlite:///{root.parent / STORE_DIR / STORE_DB}"


def shown(uri: str) -> str:
    """The URI without a password, for messages."""
    parts = urllib.parse.urlsplit(uri)
    if not parts.password:
        return uri
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_reachable(uri: str) -> None:
    """An HTTP server must answer (any HTTP status counts: it is there); a SQLite or file store must be
    in a folder that exists or can be made, and is writable."""
    try:
        scheme = urllib.parse.urlsplit(uri).scheme
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise RecipeError(f"MLflow tracking URI {uri!r} is not a URI ({exc})") from None
    if scheme in ("http", "https"):
        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S).close()
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise RecipeError(
                f"MLflow tracking URI {shown(uri)} is unreachable ({reason}); nothing published"
            ) from None
    elif scheme in ("sqlite", "file", ""):
        path = _local_store_path(uri)
        folder = path.parent if scheme == "sqlite" else path
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            raise RecipeError(f"MLflow tracking URI {uri}: {folder} is not a writable directory; nothing published")


def _local_store_path(uri: str) -> Path:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    if uri.startswith("file:"):
        return Path(urllib.parse.urlsplit(uri).path)
    return Path(uri)


def _artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps its files: beside a SQLite store (MLflow's own default is ./mlruns
    under whatever folder the command ran in); a server or file store decides for itself."""
    if uri.startswith("sqlite:///"):
        return (_local_store_path(uri).parent / "artifacts").resolve().as_uri()
    return None


def flatten(value, prefix: str = "") -> dict:
    """Nested dicts as {'a.b.c': leaf}."""
    if isinstance(value, dict):
        out: dict = {}
        for key, inner in value.items():
            out.update(flatten(inner, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def params_of(manifest: dict) -> dict[str, str]:
    """The resolved recipe, one param per leaf: strings as they are, other values as JSON (null, lists),
    cut to MLflow's length limit."""
    recipe = flatten(manifest["recipe"]["resolved"])
    params = {"recipe": manifest["recipe"]["name"]}
    for key, value in recipe.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        params[key] = text[:PARAM_VALUE_MAX]
    return params


def metrics_of(manifest: dict) -> dict[str, float]:
    """Every number the evaluation measured (baseline.* and candidate.*), and each gate check's value,
    threshold and outcome (gate.NAME.value / .threshold / .passed as 1 or 0)."""
    metrics = {}
    for side in ("baseline", "candidate"):
        for key, value in flatten(manifest["metrics"].get(side) or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[f"{side}.{key}"] = float(value)
    for check in manifest["gate"]["checks"]:
        if check["value"] is not None:
            metrics[f"gate.{check['name']}.value"] = float(check["value"])
        metrics[f"gate.{check['name']}.threshold"] = float(check["threshold"])
        metrics[f"gate.{check['name']}.passed"] = 1.0 if check["passed"] else 0.0
    metrics["gate.passed"] = 1.0 if manifest["gate"]["passed"] else 0.0
    return metrics


def _quiet() -> None:
    """MLflow and alembic log at INFO while creating a store; the command's own line says what happened.
    (After importing mlflow, which sets its logger's level when imported.)"""
    import mlflow  # noqa: F401

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # A server that goes away mid-upload: fail in seconds, not after MLflow's default minutes of retries.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")


def publish(root: Path, manifest: dict, settings: dict) -> str:
    uri = tracking_uri(root, settings)
    check_reachable(uri)
    _quiet()
    from mlflow.exceptions import MlflowException
    from requests.exceptions import RequestException

    try:
        return _publish(root, manifest, settings, uri)
    except (MlflowException, RequestException, OSError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise RecipeError(f"MLflow at {shown(uri)} refused the upload: {first}; nothing published") from None


def _publish(root: Path, manifest: dict, settings: dict, uri: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment_id = _experiment(client, settings.get("experiment") or "optimize", uri)
    name = model_name(manifest, settings)
    version_tags = tags(manifest)
    run = client.create_run(
        experiment_id, run_name=f"{manifest['recipe']['name']}-{manifest['id'][:12]}", tags=version_tags
    )
    run_id, version = run.info.run_id, None
    try:
        _log_run(client, run_id, root, manifest)
        version = _register(client, name, run, version_tags, manifest)
        client.set_terminated(run_id)
    except BaseException:
        _take_back(client, run_id, name, version)
        raise
    where = f"model {name} version {version.version} (run {run_id}, gate {manifest['verdict']})"
    return f"published to MLflow {shown(uri)}: {where}"


def _take_back(client, run_id: str, name: str, version) -> None:
    """Undo a publish that failed halfway (no half-registered version left); best effort, since the
    failure may be the server going away."""
    with contextlib.suppress(Exception):
        if version is not None:
            client.delete_model_version(name, version.version)
    with contextlib.suppress(Exception):
        client.set_terminated(run_id, "FAILED")
        client.delete_run(run_id)


def _experiment(client, name: str, uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return client.create_experiment(name, artifact_location=_artifact_location(uri))


def _log_run(client, run_id: str, root: Path, manifest: dict) -> None:
    from mlflow.entities import Metric, Param

    params = [Param(k, v) for k, v in params_of(manifest).items()]
    for start in range(0, len(params), BATCH):
        client.log_batch(run_id, params=params[start : start + BATCH])
    stamp = _millis(manifest)
    metrics = [Metric(k, v, stamp, 0) for k, v in metrics_of(manifest).items()]
    for start in range(0, len(metrics), BATCH * 10):
        client.log_batch(run_id, metrics=metrics[start : start + BATCH * 10])
    client.log_artifacts(run_id, str(root), "artifact")  # the whole artifact: what the model version is
    for name in ("manifest.json", REPORT_MD, JUNIT_XML):
        if (root / name).is_file():
            client.log_artifact(run_id, str(root / name))
    for plot in plots(manifest):
        client.log_artifact(run_id, str(root / plot), "plots")


def _millis(manifest: dict) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(manifest["created"]).timestamp() * 1000)


def _register(client, name: str, run, version_tags: dict, manifest: dict):
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=f"optimize artifacts of recipe {manifest['recipe']['name']}")
    return client.create_model_version(
        name,
        source=f"{run.info.artifact_uri}/artifact",
        run_id=run.info.run_id,
        tags=version_tags,
        description=f"gate {manifest['verdict']}; manifest {manifest['id']}",
    )
