"""Run this bundle: `python run.py "some text" "more text"` (no text: one per line on stdin).

A sentence-encoder bundle embeds the texts; a text-classifier bundle prints each text's labels with
their softmax scores, highest first (as the server's /predict answers); a causal-LM bundle (ONNX
Runtime GenAI) continues each text as a prompt, greedily, up to --max-tokens new tokens, as the
server does with temperature 0.

It needs only its runtime: onnxruntime (openvino for an OpenVINO bundle), tokenizers and numpy, or
onnxruntime-genai and numpy for a causal LM, or for a TensorRT-RTX plan tensorrt-rtx, cuda-python,
tokenizers, numpy and an RTX-class NVIDIA GPU (elsewhere it refuses with one line naming what is
missing); requirements.txt pins the versions the model was
evaluated with. Before anything is loaded, every file is checked against manifest.json by
artifact/, the checker the pipeline and its server use (copied here and itself listed in the
manifest), or by the installed project's own when this Python has the project. Texts are
tokenized and run exactly as the server runs them: an encoder's graph pools (and normalizes, when
the model does) inside, so its `sentence_embedding` output is the embedding.

Prints one JSON value per text (an embedding's array, a continuation's string), or with
`--output FILE` writes them: a float32 .npy array [texts, dim] for embeddings, a .json list of
strings for continuations. Exit 0 on success; 2 when the bundle is refused or the input is bad
(one line `error: ...`).

What the check is worth: it catches accidents (a file changed, lost or added in a copy), not an
attacker. Whoever can replace a file of the bundle can replace artifact/ too, and a checker
cannot vouch for itself, so --key and --require-signature here prove nothing about a bundle that
may have been tampered with. Check its signature with a checker from outside the bundle: the
installed project's `python -m optimize.verify BUNDLE --key FILE --require-signature`.
"""

import sys

# Before any other import: `python run.py` puts this folder first on the module search path, so a
# numpy.py or argparse.py added to the bundle would run before the bundle is checked. Nothing is
# imported from here but by its path: the checker package artifact/, then, once the bundle matched
# its manifest, runtimes.py (and a plan's runner). (-I and -P do not add the folder.)
if not (sys.flags.isolated or getattr(sys.flags, "safe_path", False)):
    del sys.path[0]

import os  # noqa: E402  (from the standard library now that the folder is off the path)

# A PYTHONPATH entry naming this folder (`PYTHONPATH=.` from inside it) would reach it as well.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _HERE]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NoReturn  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(_HERE)
OUTPUT = "sentence_embedding"
OUTPUTS = {"sentence_embedding": OUTPUT, "text_classification": "logits"}  # what each task's graph returns
ENCODERS = tuple(OUTPUTS)
MAX_THREADS = 1024  # past this a runtime's thread option overflows or exhausts the machine


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(message)


def checker_package() -> Path:
    """The checker to run (a package folder): the installed project's when this Python has the project,
    else the bundle's copy. A bundle cannot vouch for itself (a replaced artifact/ passes its own check);
    the project's checker finds a replaced file of artifact/ changed, like any other file."""
    for entry in sys.path:  # this folder is no longer on it
        root = entry or os.curdir
        installed = os.path.join(root, "engines", "artifact")
        if os.path.isfile(os.path.join(root, "optimize", "verify.py")) and os.path.isfile(
            os.path.join(installed, "__init__.py")
        ):
            return Path(installed)
    return HERE / "artifact"


def load_by_path(path: Path, name: str, what: str):
    """The module at `path`, loaded by its path under the private `name` (never imported by name from
    this folder). A path without .py is a package's folder: its __init__.py runs registered as `name`,
    so its relative imports (`from .files import ...`) resolve inside that folder and nowhere else."""
    # No __pycache__ beside it: the bundle must keep exactly the files its manifest lists.
    sys.dont_write_bytecode = True
    package = path.suffix != ".py"
    source = path / "__init__.py" if package else path
    spec = importlib.util.spec_from_file_location(
        name, source, submodule_search_locations=[str(path)] if package else None
    )
    if spec is None or spec.loader is None or not source.is_file():
        missing = f"{path.name}/" if package and not path.is_dir() else source.relative_to(path.parent).as_posix()
        fail(f"{path.parent}: {missing} ({what}) is missing; refused")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: where a package's own imports find their parent
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a damaged copy (truncated, edited) raises whatever its code raises
        own = (getattr(exc, "name", None) or "") if isinstance(exc, ModuleNotFoundError) else ""
        if package and own.startswith(name + "."):  # one of the package's own modules is not there
            fail(f"{path.parent}: {path.name}/{own[len(name) + 1 :].replace('.', '/')}.py ({what}) is missing; refused")
        reason = " ".join(str(exc).split())[:200]
        fail(f"{source}: {what} cannot be loaded ({type(exc).__name__}: {reason}); refused")
    return module


def checked_manifest(checker, key_file: str | None, require_signature: bool) -> dict:
    """The manifest, after every file of the bundle matched it (and its signature, with a key)."""
    try:
        key = checker.read_key(key_file) if key_file else None
        problems = checker.verify(HERE, key, require_signature)
        manifest = checker.read_manifest(HERE)
    except checker.ArtifactError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{HERE}: {exc.strerror or exc}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        fail(f"{HERE} does not match its manifest: {problems[0]}{more}; refused")
    return manifest


def tensorrt_rtx_model(path: Path):
    """A TensorRT-RTX plan on an RTX-class GPU, run by the bundle's tensorrt_rtx_runner.py (checked with
    every other file, and loaded by its path like the checker)."""
    module = load_by_path(HERE / "tensorrt_rtx_runner.py", "bundle_tensorrt_rtx_runner", "the plan runner")
    try:
        runner = module.RtxPlanRunner(path)
    except module.Unavailable as exc:
        fail(str(exc))

    def run(feed: dict[str, np.ndarray]) -> np.ndarray:
        try:
            return runner(feed)[OUTPUT]
        except ValueError as exc:  # a batch or text outside every optimization profile of the plan
            fail(f"{exc} (try a smaller --batch-size)")

    return run


def load_model(engine: dict, threads: int, runtimes):
    path = HERE / engine["file"]
    if engine.get("format") == "tensorrt-rtx":
        return tensorrt_rtx_model(path)
    output = OUTPUTS.get(str(engine.get("task")), OUTPUT)
    if engine.get("format") == "openvino":
        return runtimes.openvino_model(path, engine, threads, output)
    return runtimes.onnxruntime_model(path, threads, output)


def read_texts(args) -> list[str]:
    """The texts from the arguments, or one per line of stdin; each must be valid UTF-8 (the
    tokenizers take nothing else, and the arguments hold undecodable bytes as lone surrogates)."""
    if args.texts:
        texts = list(args.texts)
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                fail(f"text argument {i + 1} is not valid UTF-8")
    else:
        data = sys.stdin.buffer.read()
        try:
            lines = data.decode("utf-8").split("\n")
        except UnicodeDecodeError as exc:
            fail(f"stdin is not valid UTF-8 (byte {exc.start})")
        texts = lines[:-1] if lines[-1] == "" else lines
    if not texts:
        fail("no text given: give texts as arguments or one per line on stdin")
    return texts


def embed(texts: list[str], manifest: dict, threads: int, batch_size: int) -> np.ndarray:
    engine = manifest["engine"]
    # Checked with every other file before it runs, and loaded by its path like the checker.
    runtimes = load_by_path(HERE / "runtimes.py", "bundle_runtimes", "the runtime loaders")
    tokens = runtimes.Tokens(HERE / engine.get("tokenizer", "tokenizer"), int(engine.get("max_length") or 128))
    model = load_model(engine, threads, runtimes)
    # Each batch is padded to its own longest text: the graph pools over the attention mask, so
    # padding does not change an embedding.
    parts = [model(tokens(texts[i : i + batch_size])) for i in range(0, len(texts), batch_size)]
    return np.concatenate(parts).astype(np.float32)


def classify(texts: list[str], manifest: dict, threads: int, batch_size: int, parse_json) -> list[list[dict]]:
    """Per text every label with its softmax score, highest first (what the server's /predict answers)."""
    try:
        id2label = parse_json((HERE / "labels.json").read_bytes())["id2label"]
        labels = [str(id2label[str(i)]) for i in range(len(id2label))]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        fail(f"{HERE}/labels.json: not the classifier's labels ({reason})")
    logits = embed(texts, manifest, threads, batch_size).astype(np.float64)
    scores = np.exp(logits - logits.max(axis=1, keepdims=True))
    scores /= scores.sum(axis=1, keepdims=True)
    return [[{"label": labels[i], "score": float(row[i])} for i in np.argsort(-row, kind="stable")] for row in scores]


def context_length(folder: Path, parse_json) -> int:
    """The model's context from its genai_config.json (2048 when it names none)."""
    path = folder / "genai_config.json"
    try:
        context = parse_json(path.read_bytes())["model"].get("context_length") or 2048
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # JSONInputError is a ValueError
        fail(f"{path}: not a usable GenAI config ({' '.join(str(exc).split())[:200] or type(exc).__name__})")
    if not isinstance(context, int) or context < 2:
        fail(f"{path}: context_length {context!r} is not a length")
    return context


def generate(prompts: list[str], manifest: dict, threads: int, max_tokens: int, parse_json) -> list[str]:
    """Greedy continuations with ONNX Runtime GenAI: the server's search options at temperature 0
    (the prompt plus max_tokens, within the model's context), stopping at an end-of-sequence token."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        fail("this bundle needs onnxruntime-genai: pip install -r requirements.txt")
    folder = HERE / manifest["engine"].get("dir", ".")
    context = context_length(folder, parse_json)
    config = og.Config(str(folder))
    if threads:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    tokenizer = og.Tokenizer(model)
    eos = {int(t) for t in tokenizer.eos_token_ids}
    texts = []
    for prompt in prompts:
        ids = [int(t) for t in tokenizer.encode(prompt)]
        if not ids or len(ids) >= context:
            fail(f"a prompt has {len(ids)} tokens; this model takes 1 to {context - 1}")
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=min(context, len(ids) + max_tokens), do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        produced: list[int] = []
        while len(produced) < max_tokens and not generator.is_done():
            generator.generate_next_token()
            token = int(generator.get_next_tokens()[0])
            if token in eos:
                break
            produced.append(token)
        texts.append(tokenizer.decode(produced))
    return texts


class Output:
    """--output, checked and reserved before anything is computed: a temporary file is made beside it
    at once (so a folder that cannot be written costs nothing) and renamed into place once written
    (so an error leaves no partial file)."""

    def __init__(self, path: Path, suffix: str):
        if path.suffix != suffix or not os.path.isdir(path.parent):
            fail(f"--output {path}: give a {suffix} file in an existing folder")
        folder = Path(os.path.realpath(path.parent))
        if folder == HERE or HERE in folder.parents:
            # A file here would make every later run refuse the bundle (a file not in its manifest).
            fail(f"--output {path} is inside the bundle; write it elsewhere")
        if os.path.isdir(path):
            fail(f"--output {path} is a folder; give a {suffix} file")
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".run-output-", suffix=".tmp")
        except OSError as exc:
            fail(f"--output {path}: cannot write in {path.parent} ({exc.strerror or exc})")
        self.path, self.tmp, self.file = path, Path(tmp), os.fdopen(fd, "wb")

    def commit(self, results: list | np.ndarray) -> None:
        """Embeddings as a float32 .npy array, continuations (or a classifier's labels) as .json."""
        try:
            with self.file:
                if isinstance(results, np.ndarray):
                    np.save(self.file, results, allow_pickle=False)
                else:
                    self.file.write(json.dumps(results).encode())
            os.replace(self.tmp, self.path)
        except OSError as exc:
            fail(f"--output {self.path}: {exc.strerror or exc}")

    def discard(self) -> None:
        """Remove the temporary file unless commit renamed it into place."""
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def check_engine(engine: dict, task: str) -> None:
    """The engine fields run.py reads, so a manifest without them is one line, not a KeyError."""
    if task in ENCODERS and not isinstance(engine.get("file"), str):
        fail(f"{HERE}: the manifest's engine names no model file; refused")
    max_length = engine.get("max_length")
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
        fail(f"{HERE}: the manifest's engine.max_length {max_length!r} is not a length; refused")


SECURITY = """The check against manifest.json, and of its signature with --key, is made by this
bundle's own artifact/: it catches accidents (a file changed, lost or added), not tampering, since
whoever can replace the bundle's files can replace its checker too. A signature is only as
trustworthy as its verifier, which must come from outside the bundle: python -m optimize.verify
BUNDLE --key FILE --require-signature, with the project installed."""


def main(argv: list[str]) -> int:
    parser = _Parser(
        prog="run.py",
        description="Embed texts, or continue prompts, with this bundle.",
        epilog=SECURITY,
    )
    parser.add_argument("texts", nargs="*", help="texts to embed or prompts to continue (default: stdin lines)")
    parser.add_argument("--output", type=Path, help="write .npy (embeddings) or .json (continuations) instead")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default: the runtime's choice)")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per run of an encoder")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt of a causal LM")
    parser.add_argument(
        "--key", help="file holding the HMAC secret the manifest was signed with (checked by the bundle itself: below)"
    )
    parser.add_argument("--require-signature", action="store_true", help="refuse an unsigned manifest")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.max_tokens < 1 or not 0 <= args.threads <= MAX_THREADS:
        fail(f"--batch-size and --max-tokens must be >= 1, --threads 0 to {MAX_THREADS}")
    checker = load_by_path(checker_package(), "bundle_artifact_checker", "the checker")
    manifest = checked_manifest(checker, args.key, args.require_signature)
    engine = manifest.get("engine") or {}
    task = engine.get("task")
    if task not in (*ENCODERS, "causal_lm"):
        fail(f"{HERE}: this bundle's model is a {task!r}; run.py embeds, classifies or continues text only")
    check_engine(engine, task)
    suffix = ".npy" if task == "sentence_embedding" else ".json"
    output = Output(args.output, suffix) if args.output is not None else None
    try:
        texts = read_texts(args)
        results: list | np.ndarray
        if task == "causal_lm":
            results = generate(texts, manifest, args.threads, args.max_tokens, checker.parse_json)
        elif task == "text_classification":
            results = classify(texts, manifest, args.threads, args.batch_size, checker.parse_json)
        else:
            results = embed(texts, manifest, args.threads, args.batch_size)
        if output is not None:
            output.commit(results)
    finally:
        if output is not None:
            output.discard()
    for value in [] if output is not None else results:
        print(json.dumps(value.tolist() if isinstance(value, np.ndarray) else value))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
