"""`python -m optimize.export ARTIFACT --bundle DIR [--ort-format | --tensorrt-rtx]`: a self-contained
folder for an edge device or a laptop.

The bundle runs with only its runtime installed: onnxruntime, tokenizers and numpy for a sentence
encoder (openvino instead of onnxruntime for an OpenVINO one), onnxruntime-genai and numpy for a
causal LM. It holds the model, its tokenizer, `run.py` (embeds text, or continues prompts, from the
command line) with `runtimes.py` (how an encoder's graph runs on each runtime), a copy of the
artifact checker (the package engines/artifact/, standard library only) that run.py checks the
bundle with before loading, `requirements.txt` pinning the versions the model was
evaluated with, and a manifest with every file's sha256 (so `python -m optimize.verify DIR` checks a
bundle too). `--ort-format` converts an encoder's ONNX graph to ONNX Runtime's ORT format for mobile
and minimal builds and keeps the reduced operator set (`model.required_operators.config`) that such a
build is made from. `--tensorrt-rtx` bundles an engine=tensorrt_rtx artifact's plan instead of its
ONNX graph, for an RTX-class GPU: run.py runs it with tensorrt-rtx and cuda-python (the bundle
carries the plan runner, engines/tensorrt_rtx/runner.py) and refuses with one line elsewhere.

OpenVINO GenAI causal LMs, image classifiers and simulated-quantization checkpoints are refused with
one line (`python -m serve` runs the OpenVINO GenAI ones).

`python -m optimize.export ARTIFACT --to vllm DIR` writes a folder `vllm serve DIR` loads: a causal
LM's Hugging Face checkpoint (engine=compressed_tensors_checkpoint: INT8 W8A8 or INT4 W4A16 weights
vLLM serves on CPU and GPU; engine=modelopt_checkpoint: modelopt's FP8 export), its generation config
and the artifact's tokenizer, plus optimize_export.json naming the artifact, what was measured and
each file's sha256 (optimize/export/vllm.py). Other engines hold no checkpoint vLLM reads and are
refused with one line.

Exit 0 with the bundle written; 2 when the artifact is refused (not an artifact, changed files, a bad
signature, a failed gate without --allow-failed-gate, a model the bundle cannot carry) or the
destination cannot be used: one line `error: ...`, nothing written.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import os
import shutil
import sys
from pathlib import Path

import engines.artifact as checker
from engines.artifact import VERIFY_KEY_ENV, ArtifactError
from engines.formats import ONNXRUNTIME, ONNXRUNTIME_GENAI, OPENVINO, TENSORRT_RTX
from optimize import EXIT_BAD_INPUT
from optimize.artifact import publish, scratch_for, staging, write_manifest
from optimize.errors import ArgumentParser, RecipeError
from optimize.export.vllm import write_vllm

BUNDLE_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "bundle"
RUN_SCRIPT, RUNTIMES = BUNDLE_ASSETS / "run.py", BUNDLE_ASSETS / "runtimes.py"  # the command, its graph runners
CHECKER = Path(checker.__file__).resolve().parent  # the package's folder: the bundle carries its modules
CHECKER_DIR = "artifact"  # where they go in the bundle (run.py loads the package from there by its path)
PLAN_RUNNER = CHECKER.parent / "tensorrt_rtx" / "runner.py"  # numpy and the standard library until a plan loads
PLAN_RUNNER_NAME = "tensorrt_rtx_runner.py"  # its name in the bundle, where run.py loads it by its path
ORT_FILE, OPERATORS_FILE = "model.ort", "model.required_operators.config"
# The packages run.py imports, by engine format: what the bundle needs and nothing else.
RUNTIME_PACKAGES = {
    ONNXRUNTIME: ("onnxruntime", "tokenizers", "numpy"),
    OPENVINO: ("openvino", "tokenizers", "numpy"),
    ONNXRUNTIME_GENAI: ("onnxruntime-genai", "numpy"),  # its tokenizer is its own
    TENSORRT_RTX: ("tensorrt-rtx", "cuda-python", "tokenizers", "numpy"),
}
# cuda.bindings.runtime (what the plan runner imports) is in cuda-python from 12.6.
UNPINNED_FLOOR = {"cuda-python": ">=12.6"}
# What run.py does with each engine format: the tasks it takes (a text classifier's bundle prints
# each text's labels and scores, named from the artifact's labels.json).
TASKS = {
    ONNXRUNTIME: ("sentence_embedding", "text_classification"),
    OPENVINO: ("sentence_embedding", "text_classification"),
    ONNXRUNTIME_GENAI: ("causal_lm",),
    TENSORRT_RTX: ("sentence_embedding",),
}
LABELS_FILE = "labels.json"
BUNDLE_FILES = ("run.py", RUNTIMES.name, "requirements.txt", PLAN_RUNNER_NAME)  # and every file under CHECKER_DIR/


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m optimize.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--bundle", type=Path, help="the folder to write (new, or empty)")
    parser.add_argument(
        "--to",
        nargs=2,
        metavar=("FORMAT", "DIR"),
        help="write the model for another server instead of a bundle: --to vllm DIR (a new, or empty, folder)",
    )
    parser.add_argument(
        "--ort-format",
        action="store_true",
        help="convert the ONNX graph to ORT format and keep its reduced operator set (mobile / minimal builds)",
    )
    parser.add_argument(
        "--tensorrt-rtx",
        action="store_true",
        help="bundle the artifact's TensorRT-RTX plan (engine=tensorrt_rtx) for an RTX-class GPU instead of its ONNX",
    )
    parser.add_argument("--key", help=f"HMAC key file to check the artifact's signature (default: ${VERIFY_KEY_ENV})")
    parser.add_argument("--require-signature", action="store_true", help="refuse an unsigned artifact")
    parser.add_argument("--allow-failed-gate", action="store_true", help="bundle an artifact whose gate failed")
    args = parser.parse_args(argv)
    if (args.bundle is None) == (args.to is None):
        parser.error("give one of --bundle DIR or --to vllm DIR")
    if args.to is not None:
        return export_to(args)
    try:
        source = checked_source(args.artifact, args.key, args.require_signature, args.allow_failed_gate)
        if args.tensorrt_rtx:
            source = with_plan_engine(args.artifact, source, args.ort_format)
        check_bundle_destination(args.bundle, args.artifact)
        manifest = write_bundle(args.artifact, source, args.bundle, args.ort_format)
    except (RecipeError, ArtifactError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:  # the destination's folder cannot be read or written (staging removed the partial)
        print(f"error: --bundle {args.bundle}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    size_mb, about = sum(f["bytes"] for f in manifest["files"]) / 2**20, manifest["bundle"]
    needs = " ".join(about["requirements"])
    print(
        f"bundle: {args.bundle} ({len(manifest['files'])} files, {size_mb:.1f} MB, {about['model_format']}); "
        f"needs {needs}; run: python {args.bundle / 'run.py'} TEXT"
    )
    return 0


def export_to(args) -> int:
    """--to FORMAT DIR: the artifact's model as another server reads it (vllm only)."""
    target, dest = args.to[0], Path(args.to[1])
    try:
        if target != "vllm":
            raise RecipeError(f"--to {target}: the formats written are: vllm")
        source = checked_manifest(args.artifact, args.key, args.require_signature, args.allow_failed_gate)
        check_bundle_destination(dest, args.artifact, "--to vllm")
        written = write_vllm(args.artifact, source, dest)
    except (RecipeError, ArtifactError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"error: --to vllm {dest}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    size_mb = sum(f["bytes"] for f in written["files"]) / 2**20
    print(
        f"vllm: {dest} ({len(written['files'])} files, {size_mb:.1f} MB, {written['quantization']}); "
        f"serve: vllm serve {dest}"
    )
    return 0


def checked_manifest(
    root: Path, key_file: str | None, require_signature: bool, allow_failed_gate: bool, action: str = "export"
) -> dict:
    """The artifact's manifest after the checker found every file as recorded and its gate passed."""
    key_file = key_file or os.environ.get(VERIFY_KEY_ENV)
    try:
        key = checker.read_key(key_file) if key_file else None
        problems = checker.verify(root, key, require_signature)
        manifest = checker.read_manifest(root)
    except OSError as exc:
        raise RecipeError(f"{root}: {exc.strerror or exc}") from None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RecipeError(f"{root} does not match its manifest: {problems[0]}{more}; refused")
    if "bundle" in manifest:
        raise RecipeError(f"{root} is already a bundle; export the artifact it was made from")
    if (manifest.get("gate") or {}).get("passed") is not True and not allow_failed_gate:
        raise RecipeError(f"{root}: the gate did not pass; refusing to {action} it (--allow-failed-gate overrides)")
    return manifest


def checked_source(root: Path, key_file: str | None, require_signature: bool, allow_failed_gate: bool) -> dict:
    """The artifact's manifest, after the one checker found every file as recorded; then what a bundle
    can carry: a sentence encoder on ONNX Runtime or OpenVINO, a causal LM on ONNX Runtime GenAI."""
    manifest = checked_manifest(root, key_file, require_signature, allow_failed_gate, action="bundle")
    engine = manifest.get("engine") or {}
    fmt, task = engine.get("format"), engine.get("task")
    if fmt not in RUNTIME_PACKAGES:
        raise RecipeError(
            f"{root}: a {fmt!r} engine cannot be bundled (bundles carry onnxruntime and openvino sentence "
            f"encoders and onnxruntime-genai causal LMs; serve the others with python -m serve)"
        )
    if task not in TASKS[fmt]:
        runs = " and ".join(TASKS[fmt])
        raise RecipeError(f"{root}: a {task!r} model on {fmt} cannot be bundled (run.py runs {runs} there)")
    needed = ("dir",) if fmt == ONNXRUNTIME_GENAI else ("file", "tokenizer")
    if not all(engine.get(key) for key in needed):
        raise RecipeError(f"{root}: the manifest's engine names no {' or '.join(needed)}; cannot bundle it")
    return manifest


def with_plan_engine(root: Path, source: dict, ort_format: bool) -> dict:
    """The manifest with its engine block replaced by the plan's (engine.plan, which engine=tensorrt_rtx
    writes beside the ONNX graph it was built from); what was measured on what is kept with it."""
    if ort_format:
        raise RecipeError("--tensorrt-rtx and --ort-format choose different model files: give one")
    engine = source["engine"]
    plan = engine.get("plan") if engine.get("format") == ONNXRUNTIME else None
    if engine.get("format") == TENSORRT_RTX:
        plan = engine.get("plan") or {"file": engine.get("file")}
    listed = {entry["path"] for entry in source["files"]}
    if not isinstance(plan, dict) or plan.get("file") not in listed:
        raise RecipeError(f"{root}: the artifact has no TensorRT-RTX plan (build one with engine=tensorrt_rtx)")
    if engine.get("task") not in TASKS[TENSORRT_RTX] or not engine.get("tokenizer"):
        raise RecipeError(f"{root}: a TensorRT-RTX bundle carries a sentence encoder with its tokenizer")
    checker.contained(root, plan["file"], "engine.plan.file")
    kept = {k: engine[k] for k in ("task", "max_length", "tokenizer", "precision") if k in engine}
    return {**source, "engine": {"format": TENSORRT_RTX, "file": plan["file"], **kept, "plan": plan}}


def check_bundle_destination(bundle: Path, artifact: Path, option: str = "--bundle") -> None:
    if os.path.islink(bundle) or (bundle.exists() and not bundle.is_dir()):
        raise RecipeError(f"{option} {bundle} is a file or a link, not a folder; refusing to write it")
    if bundle.is_dir() and any(bundle.iterdir()):
        raise RecipeError(f"{option} {bundle} already exists and is not empty")
    target, source = bundle.resolve(), artifact.resolve()
    if target == source or source in target.parents:
        raise RecipeError(f"{option} {bundle} is inside the artifact; the artifact would no longer match its manifest")


def write_bundle(root: Path, source: dict, bundle: Path, ort_format: bool) -> dict:
    """Build the bundle in a hidden folder beside `bundle` and rename it into place once its manifest is
    written: an error or an interrupt leaves nothing."""
    engine = dict(source["engine"])
    with staging(bundle) as stage:
        carried = runtime_files(root, source)
        if ort_format:
            carried = [path for path in carried if path not in onnx_files(root, engine)]
            convert_to_ort(root / engine["file"], stage, scratch_for(stage))
            engine["file"] = ORT_FILE
        clashes = sorted(p for p in carried if p in BUNDLE_FILES or p.split("/")[0] == CHECKER_DIR)
        if clashes:
            raise RecipeError(f"{root}: the artifact has files named like the bundle's own ({', '.join(clashes)})")
        for path in carried:
            (stage / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / path, stage / path)
        requirements = pinned_requirements(source, engine["format"])
        (stage / "requirements.txt").write_text(
            "# What run.py imports, at the versions the model was evaluated with.\n" + "\n".join(requirements) + "\n"
        )
        shutil.copyfile(RUN_SCRIPT, stage / "run.py")
        shutil.copyfile(RUNTIMES, stage / RUNTIMES.name)
        (stage / CHECKER_DIR).mkdir()
        for module in sorted(CHECKER.glob("*.py")):
            shutil.copyfile(module, stage / CHECKER_DIR / module.name)
        if engine["format"] == TENSORRT_RTX:
            shutil.copyfile(PLAN_RUNNER, stage / PLAN_RUNNER_NAME)
        manifest = write_manifest(stage, bundle_manifest(source, engine, requirements, ort_format))
        publish(stage, bundle)
    return manifest


def runtime_files(root: Path, source: dict) -> list[str]:
    """The artifact's files the runtime reads: the engine's file (with an ONNX graph's external data,
    an OpenVINO IR's weights), its folder, its tokenizer. Reports and plots stay behind."""
    engine, listed = source["engine"], [entry["path"] for entry in source["files"]]
    folders = [engine[key].strip("/") for key in ("dir", "tokenizer") if engine.get(key)]
    if any(folder in ("", ".") for folder in folders):
        return listed  # the engine reads the whole artifact folder
    wanted = set(folders) | {LABELS_FILE}  # a classifier's label names, when the artifact has them
    if engine.get("file"):
        graph = str(engine["file"])
        wanted.add(graph)
        if graph.endswith(".onnx"):
            wanted |= {p.relative_to(root).as_posix() for p in checker.check_onnx_external_data(root / graph)}
        if graph.endswith(".xml"):
            wanted.add(graph[: -len(".xml")] + ".bin")
    return [path for path in listed if path in wanted or any(path.startswith(f + "/") for f in folders)]


def onnx_files(root: Path, engine: dict) -> set[str]:
    """The engine's ONNX graph and its external data: what the ORT-format file replaces."""
    if engine["format"] != ONNXRUNTIME or not str(engine["file"]).endswith(".onnx"):
        raise RecipeError(f"{root}: --ort-format converts ONNX Runtime graphs; this engine is {engine['format']}")
    graph = root / engine["file"]
    return {engine["file"], *(p.relative_to(root).as_posix() for p in checker.check_onnx_external_data(graph))}


def bundle_manifest(source: dict, engine: dict, requirements: list[str], ort_format: bool) -> dict:
    """The artifact's manifest (recipe, metrics, gate, environment) with the bundle's engine block and
    a `bundle` section naming the artifact it came from; the file table is recomputed when it is written."""
    body = {k: v for k, v in source.items() if k not in ("schema_version", "files", checker.INTEGRITY)}
    model_format = (
        "ort"
        if ort_format
        else {
            OPENVINO: "openvino-ir",
            ONNXRUNTIME_GENAI: "onnxruntime-genai",
            TENSORRT_RTX: "tensorrt-rtx-plan",
        }.get(engine["format"], "onnx")
    )
    body["engine"] = engine
    body["bundle"] = {
        "source_id": source.get("id"),
        "source_digest": source[checker.INTEGRITY]["digest"],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model_format": model_format,
        "operators_config": OPERATORS_FILE if ort_format else None,
        "requirements": requirements,
        "run": "python run.py TEXT [TEXT ...]",
    }
    return body


def pinned_requirements(manifest: dict, fmt: str) -> list[str]:
    packages = dict((manifest.get("environment") or {}).get("packages") or {})
    if fmt == TENSORRT_RTX:  # a plan loads only with the TensorRT-RTX it was built with
        packages["tensorrt-rtx"] = (manifest["engine"].get("plan") or {}).get("tensorrt_rtx")
    return [
        f"{name}=={packages[name]}" if packages.get(name) else name + UNPINNED_FLOOR.get(name, "")
        for name in RUNTIME_PACKAGES[fmt]
    ]


@contextlib.contextmanager
def quiet_logs():
    """The converter's loggers set their own INFO level; silence INFO for its duration."""
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def convert_to_ort(graph: Path, stage: Path, scratch: Path) -> None:
    """ONNX -> ORT format with ONNX Runtime's own converter ('Fixed' optimization style: the graph is
    optimized once, here, so a minimal build needs no optimizer), plus the operator list a reduced
    build is configured from."""
    from onnxruntime.tools import convert_onnx_models_to_ort as converter

    out = scratch / "ort"
    out.mkdir()
    model = out / graph.name
    shutil.copyfile(graph, model)
    for data in checker.check_onnx_external_data(graph):
        target = out / data.relative_to(graph.parent)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data, target)
    try:
        # The converter prints its progress; the command's own line says what was written.
        with contextlib.redirect_stdout(io.StringIO()), quiet_logs():
            converter.convert_onnx_models_to_ort(
                model, output_dir=out / "converted", optimization_styles=[converter.OptimizationStyle.Fixed]
            )
    except Exception as exc:  # the converter raises what ONNX Runtime raises; any of it means "cannot convert"
        text = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise RecipeError(f"{graph.name}: ONNX Runtime cannot convert it to ORT format ({text})") from None
    converted = out / "converted" / (model.stem + ".ort")
    operators = out / "converted" / (model.stem + ".required_operators.config")
    if not converted.is_file() or not operators.is_file():
        raise RecipeError(f"{graph.name}: ONNX Runtime's converter wrote no ORT model; cannot convert it")
    shutil.copyfile(converted, stage / ORT_FILE)
    # The converter names the scratch paths it read in a comment; the bundle names its own file.
    lines = [f"# - {ORT_FILE}" if line.startswith("# - ") else line for line in operators.read_text().splitlines()]
    (stage / OPERATORS_FILE).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
