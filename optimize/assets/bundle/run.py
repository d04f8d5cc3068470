"""Run this bundle: `python run.py "some text" "more text"` (no text: one per line on stdin).

A sentence-encoder bundle embeds the texts; a causal-LM bundle (ONNX Runtime GenAI) continues each
text as a prompt, greedily, up to --max-tokens new tokens, as the server does with temperature 0.

It needs only its runtime: onnxruntime (openvino for an OpenVINO bundle), tokenizers and numpy, or
onnxruntime-genai and numpy for a causal LM; requirements.txt pins the versions the model was
evaluated with. Before anything is loaded, every file is checked against manifest.json by
artifact.py, the checker the pipeline and its server use (copied here and itself listed in the
manifest). Texts are tokenized and run exactly as the server runs them: an encoder's graph pools
(and normalizes, when the model does) inside, so its `sentence_embedding` output is the embedding.

Prints one JSON value per text (an embedding's array, a continuation's string), or with
`--output FILE` writes them: a float32 .npy array [texts, dim] for embeddings, a .json list of
strings for continuations. Exit 0 on success; 2 when the bundle is refused or the input is bad
(one line `error: ...`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUTPUT = "sentence_embedding"
DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(message)


def load_checker():
    """artifact.py from this folder, loaded by path (the script's folder need not be on sys.path)."""
    # No __pycache__ beside it: the bundle must keep exactly the files its manifest lists.
    sys.dont_write_bytecode = True
    spec = importlib.util.spec_from_file_location("bundle_artifact_checker", HERE / "artifact.py")
    if spec is None or spec.loader is None or not (HERE / "artifact.py").is_file():
        fail(f"{HERE}: artifact.py (the checker) is missing; refused")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checked_manifest(key_file: str | None, require_signature: bool) -> dict:
    """The manifest, after every file of the bundle matched it (and its signature, with a key)."""
    checker = load_checker()
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


class Tokens:
    """Texts to int64 input_ids / attention_mask / token_type_ids, as the pipeline's TextEncoder makes them."""

    def __init__(self, folder: Path, max_length: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length)
        pad_id = self.tokenizer.token_to_id("[PAD]")
        self.tokenizer.enable_padding(pad_id=pad_id if pad_id is not None else 0)

    def __call__(self, texts: list[str]) -> dict[str, np.ndarray]:
        encodings = self.tokenizer.encode_batch(texts)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }


def onnxruntime_model(path: Path, threads: int):
    """ONNX Runtime on the CPU, all graph optimizations (an ORT-format file loads the same way)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = [(i.name, DTYPES.get(i.type, np.int64)) for i in session.get_inputs()]

    def run(feed: dict[str, np.ndarray]) -> np.ndarray:
        return session.run([OUTPUT], {name: feed[name].astype(dtype) for name, dtype in inputs})[0]

    return run


def openvino_model(path: Path, engine: dict, threads: int):
    """OpenVINO on the CPU with the precision the artifact was evaluated in (never the plugin's default,
    which is bf16 on CPUs that have it)."""
    import openvino as ov

    properties: dict = {
        "INFERENCE_PRECISION_HINT": engine.get("inference_precision", "f32"),
        "PERFORMANCE_HINT": engine.get("performance_hint", "LATENCY"),
    }
    if threads:
        properties["INFERENCE_NUM_THREADS"] = threads
    core = ov.Core()
    compiled = core.compile_model(core.read_model(str(path)), "CPU", properties)
    request = compiled.create_infer_request()
    # The ONNX tensor names survive conversion as port names (sorted first when a port has several).
    inputs = [(sorted(p.get_names())[0], p) for p in compiled.inputs]
    output = next(p for p in compiled.outputs if OUTPUT in p.get_names())

    def run(feed: dict[str, np.ndarray]) -> np.ndarray:
        arrays = {name: np.ascontiguousarray(feed[name], dtype=p.get_element_type().to_dtype()) for name, p in inputs}
        return request.infer(arrays, share_outputs=False)[output]

    return run


def load_model(engine: dict, threads: int):
    path = HERE / engine["file"]
    if engine.get("format") == "openvino":
        return openvino_model(path, engine, threads)
    return onnxruntime_model(path, threads)


def read_texts(args) -> list[str]:
    texts = list(args.texts) if args.texts else [line.rstrip("\n") for line in sys.stdin]
    if not texts:
        fail("no text given: give texts as arguments or one per line on stdin")
    return texts


def embed(texts: list[str], manifest: dict, threads: int, batch_size: int) -> np.ndarray:
    engine = manifest["engine"]
    tokens = Tokens(HERE / engine.get("tokenizer", "tokenizer"), int(engine.get("max_length") or 128))
    model = load_model(engine, threads)
    # Each batch is padded to its own longest text: the graph pools over the attention mask, so
    # padding does not change an embedding.
    parts = [model(tokens(texts[i : i + batch_size])) for i in range(0, len(texts), batch_size)]
    return np.concatenate(parts).astype(np.float32)


def generate(prompts: list[str], manifest: dict, threads: int, max_tokens: int) -> list[str]:
    """Greedy continuations with ONNX Runtime GenAI: the server's search options at temperature 0
    (the prompt plus max_tokens, within the model's context), stopping at an end-of-sequence token."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        fail("this bundle needs onnxruntime-genai: pip install -r requirements.txt")
    folder = HERE / manifest["engine"].get("dir", ".")
    context = int(json.loads((folder / "genai_config.json").read_text())["model"].get("context_length") or 2048)
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


def write_atomically(path: Path, write) -> None:
    """Written beside the destination and renamed into place: an error leaves no partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main(argv: list[str]) -> int:
    parser = _Parser(prog="run.py", description="Embed texts, or continue prompts, with this bundle.")
    parser.add_argument("texts", nargs="*", help="texts to embed or prompts to continue (default: stdin lines)")
    parser.add_argument("--output", type=Path, help="write .npy (embeddings) or .json (continuations) instead")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (default: the runtime's choice)")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per run of an encoder")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt of a causal LM")
    parser.add_argument("--key", help="file holding the HMAC secret the manifest was signed with")
    parser.add_argument("--require-signature", action="store_true", help="refuse an unsigned manifest")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.threads < 0 or args.max_tokens < 1:
        fail("--batch-size and --max-tokens must be >= 1, --threads >= 0")
    manifest = checked_manifest(args.key, args.require_signature)
    task = (manifest.get("engine") or {}).get("task")
    if task not in ("sentence_embedding", "causal_lm"):
        fail(f"{HERE}: this bundle's model is a {task!r}; run.py embeds text or continues prompts only")
    suffix = ".npy" if task == "sentence_embedding" else ".json"
    if args.output is not None and (args.output.suffix != suffix or not args.output.parent.is_dir()):
        fail(f"--output {args.output}: give a {suffix} file in an existing folder")
    texts = read_texts(args)
    if task == "causal_lm":
        continuations = generate(texts, manifest, args.threads, args.max_tokens)
        if args.output is not None:
            write_atomically(args.output, lambda f: f.write(json.dumps(continuations).encode()))
        for text in [] if args.output is not None else continuations:
            print(json.dumps(text))
        return 0
    vectors = embed(texts, manifest, args.threads, args.batch_size)
    if args.output is not None:
        write_atomically(args.output, lambda f: np.save(f, vectors, allow_pickle=False))
    for vector in [] if args.output is not None else vectors:
        print(json.dumps(vector.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
