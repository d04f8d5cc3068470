"""The Hugging Face Hub: a repository folder (the artifact under `artifact/`, a model card as README.md)
uploaded with huggingface_hub's `upload_folder`.

The card's YAML front matter carries base_model (model.hub_id, or model.source when it is a hub name),
the tags of every registry (verdict, engine, precision, device) and a model-index with each gate check's
value; its body says how to verify and serve the artifact and shows the gate table. The artifact keeps
its own layout under `artifact/`, so `python -m optimize.verify` checks a downloaded copy as it is.
Only the files the manifest lists (and the manifest) go: nothing else in the folder is uploaded.

`dry_run` assembles the folder and lists what would go, with no network access. Without a token, or
with HF_HUB_OFFLINE set, the upload is refused with one line before any connection.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from engines.artifact import MANIFEST
from optimize.errors import RecipeError
from optimize.publish import model_name, tags
from optimize.reports import console
from optimize.reports.ci import markdown_table, verdict_line

ARTIFACT_DIR, CARD = "artifact", "README.md"
LIBRARIES = {"onnxruntime": "onnx", "onnxruntime-genai": "onnx", "openvino": "openvino", "openvino-genai": "openvino"}
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def pipeline_tag(task_name: str) -> str | None:
    """The Hub's pipeline tag the task gives its models (None for a task this install does not know)."""
    from optimize import tasks

    return tasks.get(task_name).hub_pipeline_tag if task_name in tasks.names() else None


def check_settings(settings: dict) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo = settings.get("repo_id")
    if not repo:
        raise RecipeError("publish.repo_id is required for the Hugging Face Hub (owner/name; --repo-id)")
    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        shown = repo if repo.isprintable() else repr(repo)  # a line break in it is shown as \n
        raise RecipeError(f"publish.repo_id={shown}: {' '.join(str(exc).split())[:200]}") from None
    if settings.get("folder"):
        check_folder(Path(settings["folder"]).expanduser())


def check_folder(folder: Path) -> None:
    """--folder must be a new or empty folder that can be made: an existing file or a non-empty folder
    is refused here, a folder mkdir cannot make when it is made (assemble)."""
    if os.path.lexists(folder) and not folder.is_dir():
        raise RecipeError(f"publish.folder={folder} exists and is not a folder; give a new or empty folder")
    if folder.is_dir() and any(folder.iterdir()):
        raise RecipeError(f"publish.folder={folder} is not empty; give a new or empty folder")


def check_outside(folder: Path, root: Path) -> None:
    """The upload folder must not be the artifact or inside it: what is written there (the card, the
    copies) would be files the manifest does not list, and the artifact would no longer verify."""
    where = folder.expanduser().resolve()
    if where == root or root in where.parents:
        raise RecipeError(f"publish.folder={folder} is inside the artifact {root}; give a folder outside it")


def base_model(manifest: dict) -> str | None:
    """The hub name of the model the artifact was made from, when there is one."""
    model = manifest["recipe"]["resolved"].get("model") or {}
    for name in (model.get("hub_id"), manifest["model"]["source"]):
        if name and _HUB_NAME.match(str(name)) and not Path(str(name)).exists():
            return str(name)
    return None


def card(manifest: dict, repo_id: str) -> str:
    """The model card (README.md): front matter by huggingface_hub's own ModelCardData."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    engine, evaluation = manifest["engine"], manifest.get("evaluation") or {}
    task = pipeline_tag(str(engine.get("task") or manifest["model"].get("task")))
    labels = tags(manifest)
    measured = [c for c in manifest["gate"]["checks"] if c["value"] is not None]
    data = ModelCardData(
        base_model=base_model(manifest),
        library_name=LIBRARIES.get(str(engine.get("format"))),
        pipeline_tag=task,
        model_name=repo_id.split("/")[-1],
        tags=["optimize", labels["engine"], labels["precision"], labels["device"], f"gate-{labels['verdict']}"],
        eval_results=[
            EvalResult(
                task_type=task or "other",
                dataset_type=str(evaluation.get("source") or "unknown"),
                dataset_name=f"{evaluation.get('source')} ({evaluation.get('split')} split)",
                dataset_split=evaluation.get("split"),
                metric_type=c["name"],
                metric_name=c["metric"],
                metric_value=round(float(c["value"]), 6),
                verified=False,
            )
            for c in measured
        ]
        or None,
        optimize={k: labels[k] for k in ("verdict", "manifest_id", "parent_id", "manifest_digest")},
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{_card_body(manifest, repo_id)}"))


def _card_body(manifest: dict, repo_id: str) -> str:
    engine = manifest["engine"]
    return "\n\n".join(
        [
            f"# {repo_id.split('/')[-1]}",
            f"{manifest['model']['source']} optimized by recipe `{manifest['recipe']['name']}` to "
            f"{engine.get('format')} {engine.get('precision')}, measured against its baseline in the same run.",
            verdict_line(manifest),
            "## Use it",
            "```bash\n"
            f"hf download {repo_id} --local-dir model\n"
            f"python -m optimize.verify model/{ARTIFACT_DIR}              # every file against the manifest\n"
            f"python -m serve model/{ARTIFACT_DIR} --port 8000             # KServe v2 and OpenAI routes\n"
            "```",
            "## Gate",
            markdown_table(console.check_rows(manifest["gate"])),
            "## Baseline vs candidate",
            markdown_table(console.metrics_rows(manifest["metrics"])),
            f"manifest id `{manifest['id']}`, parent `{manifest.get('parent_id')}`; "
            f"the full report is [{ARTIFACT_DIR}/report.md]({ARTIFACT_DIR}/report.md).",
        ]
    )


def selection(manifest: dict) -> list[str]:
    """The artifact's files that go up: those its manifest lists, and the manifest."""
    return sorted([f["path"] for f in manifest["files"]] + [MANIFEST])


def assemble(root: Path, manifest: dict, repo_id: str, folder: Path) -> list[tuple[str, int]]:
    """The repository folder: README.md and artifact/<each selected file>. Returns (path, bytes) of each."""
    check_folder(folder)
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RecipeError(f"publish.folder={folder} cannot be made ({exc.strerror or type(exc).__name__})") from None
    try:
        (folder / CARD).write_text(card(manifest, repo_id))
        for rel in selection(manifest):
            dest = folder / ARTIFACT_DIR / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, dest)
    except OSError as exc:  # a full disk, a folder made read-only meanwhile: leave no half-assembled copy
        _empty(folder, remove=made)
        raise RecipeError(f"cannot assemble the upload in {folder} ({exc.strerror or type(exc).__name__})") from None
    return [(p.relative_to(folder).as_posix(), p.stat().st_size) for p in sorted(folder.rglob("*")) if p.is_file()]


def _empty(folder: Path, remove: bool) -> None:
    """Take back what assemble wrote into a folder that was new (remove it) or empty (empty it)."""
    if remove:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def publish(root: Path, manifest: dict, settings: dict) -> str:
    repo_id = settings["repo_id"]
    keep = settings.get("folder")
    if keep:
        check_outside(Path(keep), root)
    folder = Path(keep).expanduser() if keep else Path(tempfile.mkdtemp(prefix="hf-upload-")) / "repo"
    try:
        listing = assemble(root, manifest, repo_id, folder)
        lines = [f"{path}  {size} bytes" for path, size in listing]
        total = sum(size for _, size in listing) / 1e6
        if settings.get("dry_run"):
            where = f"assembled in {folder}" if keep else "nothing written"
            return "\n".join(
                [*lines, f"dry run: {len(listing)} files ({total:.1f} MB) would go to {repo_id} ({where})"]
            )
        url = _upload(folder, repo_id, manifest, settings)
        return f"published to the Hugging Face Hub: {url} ({len(listing)} files, {total:.1f} MB, {manifest['verdict']})"
    finally:
        if not keep:
            shutil.rmtree(folder.parent, ignore_errors=True)


def _upload(folder: Path, repo_id: str, manifest: dict, settings: dict) -> str:
    import httpx
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE:
        raise RecipeError(f"cannot upload to {repo_id}: the Hugging Face Hub is offline here (HF_HUB_OFFLINE=1)")
    token = get_token()
    if not token:
        raise RecipeError(f"cannot upload to {repo_id}: no Hugging Face token (set HF_TOKEN or run `hf auth login`)")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=bool(settings.get("private", True)), exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            commit_message=f"{model_name(manifest, settings)}: gate {manifest['verdict']}, id {manifest['id'][:12]}",
        )
    except (HfHubHTTPError, OfflineModeIsEnabled, httpx.HTTPError, OSError) as exc:
        first = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise RecipeError(f"upload to {repo_id} failed: {first}") from None
    return str(getattr(commit, "commit_url", None) or f"{constants.ENDPOINT}/{repo_id}")
