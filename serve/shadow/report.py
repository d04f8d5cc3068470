"""The shadow's report folder: `shadow.json` (the summary: the gate's measures of the candidate
against the artifact on live traffic, both sides' latency, the counts), and a sealed manifest that
lists it, shaped as an artifact's, so `python -m optimize.reports.compare DIR` puts the candidate's
live figures in the same table as the artifacts it compares (metrics.candidate.fidelity)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

REPORT = "shadow.json"


def manifest_for(summary: dict, artifact: dict, candidate: dict, report: bytes) -> dict:
    """A manifest for the report folder: the candidate's engine, its live figures, the report's digest."""
    from engines.artifact.integrity import seal

    figures = summary["figures"]
    fidelity = {k: figures[k] for k in ("cosine_min", "cosine_mean") if k in figures}
    metrics: dict = {"candidate": {"fidelity": fidelity, "shadow": figures}}
    for key in ("prediction_agreement", "token_agreement"):
        if key in figures:
            metrics["candidate"][key] = figures[key]
    artifact_name = ((artifact.get("recipe") or {}).get("name")) or "artifact"
    candidate_engine = candidate.get("engine") or {}
    recipe: dict = candidate["recipe"] if isinstance(candidate.get("recipe"), dict) else {}
    resolved: dict = recipe["resolved"] if isinstance(recipe.get("resolved"), dict) else {}
    return seal(
        {
            "schema_version": 2,
            "id": hashlib.sha256(report).hexdigest(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            # The candidate's own recipe, so compare's columns of differing settings stay the recipes'.
            "recipe": {
                **recipe,
                "name": f"shadow of {artifact_name}",
                "resolved": {**resolved, "shadow": {"artifact": artifact.get("id"), "candidate": candidate.get("id")}},
            },
            "engine": {k: candidate_engine[k] for k in ("format", "precision", "task") if k in candidate_engine},
            "metrics": metrics,
            "verdict": "shadow",
            "environment": candidate.get("environment") or {},
            "files": [{"path": REPORT, "bytes": len(report), "sha256": hashlib.sha256(report).hexdigest()}],
        }
    )


def folder_problem(folder: Path) -> str | None:
    """Why the report cannot be written to `folder`, or None: checked at startup by creating the
    folder and a probe file in it (then removed), so that a report folder it cannot write is one line
    before serving, not a report lost at shutdown."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe.")
        os.close(fd)
        os.unlink(probe)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        reason = getattr(exc, "strerror", None) or exc
        return f"{str(folder)[:200]}: cannot write the report there ({reason})"
    return None


def write_report(folder: Path, summary: dict, artifact: dict, candidate: dict) -> None:
    """Both files, each replaced whole (a reader never sees half of one)."""
    folder.mkdir(parents=True, exist_ok=True)
    report = json.dumps(summary, indent=2, sort_keys=True).encode()
    manifest = json.dumps(manifest_for(summary, artifact, candidate, report), indent=2).encode()
    for name, data in ((REPORT, report), ("manifest.json", manifest)):
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the report from whoever reads the artifacts
        os.replace(tmp, folder / name)
