"""MLflow: one run per published artifact, and a registered model version pointing at it.

The run holds the recipe as params, the candidate's and baseline's metrics and every gate check as
metrics, and as files the whole artifact (`artifact/`, what the model version points at) plus the
manifest, the reports and the plots at the top for the UI. The version is tagged with the verdict, the
manifest id and digest, the parent id, the engine, its precision and the device.

Tracking URI: `publish.tracking_uri` / `--tracking-uri`, else MLFLOW_TRACKING_URI, else an embedded
SQLite store beside the artifact (`mlruns/mlflow.db`, files under `mlruns/artifacts/`), which needs no
server. The output line says which one was used. Each is checked before anything is sent (and at plan
time, before a run that publishes): see check_reachable.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import socket
import sqlite3
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from optimize.errors import RecipeError
from optimize.publish import model_name, tags
from optimize.reports.ci import JUNIT_XML, REPORT_MD, plots

STORE_DIR, STORE_DB = "mlruns", "mlflow.db"
PARAM_VALUE_MAX = 6000  # MLflow's limit on a param value
BATCH = 100  # params per log_batch call (MLflow takes at most 100 params in one batch)
HEALTH_TIMEOUT_S = 5
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# Database schemes MLflow takes (with a +driver suffix too) and their servers' default ports.
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}
MLFLOW_NAMES = ("databricks", "databricks-uc", "uc")  # not folders to MLflow, and not supported here


def check_settings(settings: dict) -> None:
    configured = configured_uri(settings)
    if configured:
        check_reachable(configured[0])


def configured_uri(settings: dict) -> tuple[str, str] | None:
    """The tracking URI the settings or the environment name, and where it came from; None for the
    default store. MLflow's own variable counts as it does for MLflow's client: a URI given on the
    command line or in the recipe wins over it."""
    if settings.get("tracking_uri"):
        return str(settings["tracking_uri"]), "publish.tracking_uri"
    if os.environ.get(TRACKING_URI_ENV):
        return os.environ[TRACKING_URI_ENV], TRACKING_URI_ENV
    return None


def tracking_uri(root: Path, settings: dict) -> tuple[str, str]:
    """The URI to publish to and where it came from (said in the output line)."""
    default = f"sqlite:///{root.parent / STORE_DIR / STORE_DB}"
    return configured_uri(settings) or (default, "the default store beside the artifact")


def _split(uri: str) -> urllib.parse.SplitResult:
    """The URI's parts; a URI urllib cannot take apart (an unclosed IPv6 bracket, a port out of range)
    is one RecipeError."""
    try:
        parts = urllib.parse.urlsplit(uri)
        parts.port  # noqa: B018 -- parsed lazily: a bad port raises only here
    except ValueError as exc:
        raise RecipeError(f"MLflow tracking URI {shown(uri)!r} is not a URI ({exc}); nothing published") from None
    return parts


def shown(uri: str) -> str:
    """The URI without a password, for messages."""
    try:
        parts = urllib.parse.urlsplit(uri)
        password = parts.password
    except ValueError:
        return uri.rpartition("@")[2] if "@" in uri else uri
    if not password:
        return uri
    host = parts.netloc.rpartition("@")[2]  # as written: IPv6 brackets and the port kept
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def redacted(text: str, uri: str) -> str:
    """A library's message with the URI's password taken out (some echo the URL they were given)."""
    try:
        password = urllib.parse.urlsplit(uri).password
    except ValueError:
        return text
    return text.replace(password, "***") if password else text


def check_reachable(uri: str) -> None:
    """Before anything is sent, and at plan time before a run: an HTTP server must answer (any HTTP
    status counts: it is there), a database server must accept a connection, a SQLite or file store
    must be somewhere a file can be created. Any other scheme is refused: MLflow would find out only
    after minutes of retries, or after the run."""
    parts = _split(uri)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        _check_http(uri, parts)
    elif scheme == "sqlite":
        _check_sqlite(uri)
    elif scheme == "file" or (scheme == "" and uri.strip() and uri.split(":")[0] not in MLFLOW_NAMES):
        _check_folder(uri, _local_store_path(uri))
    elif scheme.split("+")[0] in DATABASE_PORTS:
        _check_tcp(uri, parts, DATABASE_PORTS[scheme.split("+")[0]])
    else:
        raise RecipeError(
            f"MLflow tracking URI {shown(uri)!r}: scheme {scheme or '(none)'!r} is not supported here "
            f"(use http(s)://HOST, sqlite:///PATH, file:PATH, a folder, or {'/'.join(DATABASE_PORTS)}://HOST/DB)"
        )


def _check_http(uri: str, parts: urllib.parse.SplitResult) -> None:
    """GET /health on the server. urllib does not take user:password@ in a URL (it would look up
    'user:password@host' as the host name): the credentials go in a Basic auth header instead, as
    MLflow's client (requests) sends them."""
    host = parts.netloc.rpartition("@")[2]
    url = urllib.parse.urlunsplit(parts._replace(netloc=host)).rstrip("/") + "/health"
    request = urllib.request.Request(url)
    if parts.username is not None:
        pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(pair.encode()).decode())
    try:
        urllib.request.urlopen(request, timeout=HEALTH_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as exc:  # ValueError: a URL urllib refuses
        reason = redacted(" ".join(str(getattr(exc, "reason", exc)).split()), uri)
        raise RecipeError(f"MLflow tracking URI {shown(uri)} is unreachable ({reason}); nothing published") from None


def _check_tcp(uri: str, parts: urllib.parse.SplitResult, default_port: int) -> None:
    """A database server: something must accept a TCP connection on its port."""
    if not parts.hostname:
        raise RecipeError(f"MLflow tracking URI {shown(uri)} names no database host; nothing published")
    try:
        socket.create_connection((parts.hostname, parts.port or default_port), timeout=HEALTH_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise RecipeError(f"MLflow tracking URI {shown(uri)} is unreachable ({reason}); nothing published") from None


def _check_sqlite(uri: str) -> None:
    """sqlite:///PATH (relative) or sqlite:////PATH (absolute), as SQLAlchemy reads it: a database
    file that is one, or none yet in a folder where one can be created (MLflow makes the folders)."""
    path_text = uri[len("sqlite:///") :] if uri.startswith("sqlite:///") else ""
    if not path_text or path_text == ":memory:" or "?" in path_text:
        raise RecipeError(
            f"MLflow tracking URI {shown(uri)!r} names no database file "
            "(use sqlite:///RELATIVE/PATH.db or sqlite:////ABSOLUTE/PATH.db, without ?options); nothing published"
        )
    path = Path(path_text)
    try:
        if path.is_dir() or path_text.endswith("/"):
            raise RecipeError(
                f"MLflow tracking URI {shown(uri)}: {path} is a directory, not a database file; nothing published"
            )
        if os.path.lexists(path):
            _check_database(uri, path)
        else:
            _check_folder(uri, path.parent)
    except OSError as exc:  # a name too long for the file system, a path through a file
        raise RecipeError(f"MLflow tracking URI {shown(uri)}: {exc.strerror or exc}; nothing published") from None


def _check_database(uri: str, path: Path) -> None:
    """An existing file must be an SQLite database this process can write (SQLAlchemy would fail on
    it only inside MLflow's retry loop, which waits about 100 s)."""
    if not path.is_file() or not os.access(path, os.R_OK | os.W_OK):
        raise RecipeError(f"MLflow tracking URI {shown(uri)}: {path} is not a writable regular file; nothing published")
    try:
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=rw", uri=True)) as db:
            db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as exc:
        raise RecipeError(
            f"MLflow tracking URI {shown(uri)}: {path} is not an SQLite database ({exc}); nothing published"
        ) from None


def _check_folder(uri: str, folder: Path) -> None:
    """The store's folder must exist or be creatable: its nearest existing ancestor must be a
    directory where a file can be created, which is tried (permission bits say nothing about /proc,
    a read-only mount or a full disk)."""
    folder = folder.expanduser().absolute()
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    problem = None
    if not folder.is_dir():
        problem = "not a directory"
    else:
        try:
            tempfile.TemporaryFile(dir=folder).close()
        except OSError as exc:
            problem = exc.strerror or type(exc).__name__
    if problem:
        raise RecipeError(
            f"MLflow tracking URI {shown(uri)}: cannot create the store in {folder} ({problem}); nothing published"
        )


def _local_store_path(uri: str) -> Path:
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    if uri.startswith("file:"):
        return Path(urllib.parse.unquote(urllib.parse.urlsplit(uri).path))
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


def metric_key(name: str) -> str:
    """A name MLflow accepts (alphanumerics, _ - . / and spaces): a per-point check such as
    `min_speedup[batch=32]` becomes `min_speedup.batch_32`; anything else odd becomes `_`."""
    name = name.replace("[", ".").replace("]", "").replace("=", "_")
    return re.sub(r"[^A-Za-z0-9_./ -]", "_", name)


def metrics_of(manifest: dict) -> dict[str, float]:
    """Every number the evaluation measured (baseline.* and candidate.*), and each gate check's value,
    threshold and outcome (gate.NAME.value / .threshold / .passed as 1 or 0)."""
    metrics = {}
    for side in ("baseline", "candidate"):
        for key, value in flatten(manifest["metrics"].get(side) or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[metric_key(f"{side}.{key}")] = float(value)
    for check in manifest["gate"]["checks"]:
        name = metric_key(f"gate.{check['name']}")
        if check["value"] is not None:
            metrics[f"{name}.value"] = float(check["value"])
        if check["threshold"] is not None:
            metrics[f"{name}.threshold"] = float(check["threshold"])
        metrics[f"{name}.passed"] = 1.0 if check["passed"] else 0.0
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
    # MLflow prints "View run ... at URL" with the URL as given, a password included: the command's own
    # line says where the artifact went, without it.
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def publish(root: Path, manifest: dict, settings: dict) -> str:
    uri, origin = tracking_uri(root, settings)
    check_reachable(uri)
    _quiet()
    from mlflow.exceptions import MlflowException
    from requests.exceptions import RequestException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        where = _publish(root, manifest, settings, uri)
    # ImportError: a database URI whose driver (psycopg2, pymysql, ...) is not installed.
    except (MlflowException, RequestException, SQLAlchemyError, ImportError, OSError) as exc:
        first = redacted(" ".join(str(exc).split()), uri)[:300] or type(exc).__name__
        raise RecipeError(f"MLflow at {shown(uri)} refused the upload: {first}; nothing published") from None
    return f"published to MLflow {shown(uri)}: {where}; tracking URI: {origin}"


def _publish(root: Path, manifest: dict, settings: dict, uri: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    experiment_id = _experiment(client, settings.get("experiment") or "optimize", uri)
    name = model_name(manifest, settings)
    version_tags = {**tags(manifest), "signature": str(settings.get("signature", "not checked"))}
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
    return f"model {name} version {version.version} (run {run_id}, gate {manifest['verdict']})"


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

    try:
        return int(datetime.fromisoformat(manifest["created"]).timestamp() * 1000)
    except (ValueError, OverflowError, OSError):  # a manifest edited and digested again
        raise RecipeError(f"manifest field created={manifest['created']!r} is not a date; nothing published") from None


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
