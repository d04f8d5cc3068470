"""The native GGUF engine (engines/native_gguf): a GGUF file's own Q4_0 / Q4_1 / Q8_0 blocks in the
pipeline's own kernels, scored against the file dequantized by transformers (the pipeline's baseline)
on files the tests write: equal within the activations' rounding for each type and for a file mixing
them, on the AVX-512 VNNI path and on the AVX2 one (compiled for x86-64-v3, which an AVX-512 CPU runs
too); what it cannot carry named before anything runs; its runner generates as the dequantized model
does, samples reproducibly and renders the model's chat template as transformers does. A CPU without
AVX2 is refused, naming what it lacks (checked everywhere); the kernels run where the CPU has it."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

from engines.native_gguf import build

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "jinja2", "transformers")),
    reason="needs gguf, jinja2 and transformers",
)
needs_kernels = pytest.mark.skipif(build.unavailable() is not None, reason=f"{build.unavailable()}")


def mixed(name: str) -> str:
    """Each matrix kind its own type: Q 4-bit with offsets, K 4-bit symmetric, down and the head 8-bit
    (so Q, K and V are not fused, gate and up are)."""
    for part, kind in (("attn_q", "Q4_1"), ("attn_k", "Q4_0"), ("ffn_down", "Q8_0"), ("token_embd", "Q8_0")):
        if part in name:
            return kind
    return "Q4_1"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from tests.support.models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("llama"))


def _write(folder: Path, tmp_path: Path, qtype):
    """(the GGUF path, the file dequantized by transformers)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", qtype)
    dequantized = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    return path, dequantized.eval()


def _reference_log_likelihoods(dequantized, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = dequantized(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()


def _runner_folder(folder: Path, gguf: Path) -> Path:
    """An engine folder as the engine stage writes it: the GGUF file and the tokenizer files."""
    out = gguf.parent / "engine"
    out.mkdir(exist_ok=True)
    shutil.copyfile(gguf, out / gguf.name)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, out / name)
    return out


IDS = [int(i) for i in np.random.default_rng(0).integers(1, 500, 48)]


PATHS = ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(build.path() == "AVX2", reason="native is AVX2"))]


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("march", PATHS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "mixed"])
def test_carried_blocks_compute_what_the_dequantized_file_does(folder, tmp_path, qtype, march, monkeypatch):
    from engines.native_gguf.model import kernel_path
    from engines.native_gguf.runner import NativeGGUFRunner

    monkeypatch.setenv("OPTIMIZE_NATIVE_MARCH", march)
    assert kernel_path().startswith("AVX2" if march == "x86-64-v3" else build.path())
    path, dequantized = _write(folder, tmp_path, mixed if qtype == "mixed" else qtype)
    runner = NativeGGUFRunner(_runner_folder(folder, path), path.name)
    ours = runner.log_likelihood(IDS)
    reference = _reference_log_likelihoods(dequantized, IDS)
    # 16-bit activations (15 on AVX2): within 2e-5 of each log-likelihood here; 8-bit ones (llama.cpp's)
    # round each product about 100 times more coarsely.
    np.testing.assert_allclose(ours, reference, atol=2e-4)
    assert abs(np.exp(-ours.mean()) / np.exp(-reference.mean()) - 1) < 1e-5
    # The matrices a step reads are the file's bytes (Q4_0 carried with an f16 offset: 20 bytes a block of 32).
    # Q5_0 and Q5_1: nibbles, a plane of fifth bits and an f16 scale and offset (24 bytes a block of 32).
    blocks = {"Q4_0": 20, "Q4_1": 20, "Q5_0": 24, "Q5_1": 24, "Q8_0": 34}
    layer_weights = 2 * (3 * 64 * 64 + 3 * 64 * 128)  # 2 layers: q, o 64x64, k, v 32x64, gate, up, down 64x128
    if qtype != "mixed":
        assert runner.model.weight_bytes_per_token == (layer_weights + 512 * 64) // 32 * blocks[qtype]


def _log_likelihoods(model, ids: list[int]) -> np.ndarray:
    logits = model.forward(ids, 0).astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return log_probs[np.arange(len(ids) - 1), ids[1:]]


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory) -> Path:
    """A Llama of width 256 and feed-forward width 512: every matrix row whole K-quant super-blocks."""
    from tests.support.models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("wide"), hidden=256, ffn=512)


def k_mixed(name: str) -> str:
    """Q4_K_M's pattern at this size: V, down and the embedding Q6_K, Q Q5_K, the rest Q4_K."""
    for part, kind in (("attn_v", "Q6_K"), ("ffn_down", "Q6_K"), ("token_embd", "Q6_K"), ("attn_q", "Q5_K")):
        if part in name:
            return kind
    return "Q4_K"


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("march", PATHS)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "k_mixed"])
def test_k_quant_blocks_compute_what_the_dequantized_file_does(wide_folder, tmp_path, qtype, march, monkeypatch):
    """Super-blocks of 256 with 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scales, repacked with each
    sub-block's scale and min as the exact f32 product: the dequantized file's log-likelihoods within the
    activations' rounding (the f32 KV cache: the weights alone), and Q4_K's bytes at 12 a 32 values."""
    from engines.native_gguf.model import NativeGGUF

    monkeypatch.setenv("OPTIMIZE_NATIVE_MARCH", march)
    path, dequantized = _write(wide_folder, tmp_path, k_mixed if qtype == "k_mixed" else qtype)
    model = NativeGGUF(path, context=256, kv_cache="f32")
    ours, reference = _log_likelihoods(model, IDS), _reference_log_likelihoods(dequantized, IDS)
    np.testing.assert_allclose(ours, reference, atol=4e-4)  # Q4_1 on this model: 1e-4 (2e-4 on AVX2)
    assert abs(np.exp(-ours.mean()) / np.exp(-reference.mean()) - 1) < 3e-5
    if qtype == "Q4_K":  # 4-bit nibbles and an f32 scale and offset a row and 32 values: 384 bytes a group-block
        layer_weights = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 512)
        assert model.weight_bytes_per_token == layer_weights // 32 * 24 + 512 * 256 // 32 * 24


def packed(name: str) -> str:
    """Every packed 5- and 6-bit group-block in one file: Q and gate|up Q5_0, K Q5_1, V and down Q6_K, the
    output projection and the embedding (the head, tied) Q5_K."""
    kinds = (("attn_q", "Q5_0"), ("attn_k", "Q5_1"), ("attn_v", "Q6_K"), ("ffn_down", "Q6_K"), ("ffn_", "Q5_0"))
    for part, kind in kinds:
        if part in name:
            return kind
    return "Q5_K"


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("march", PATHS)
def test_packed_5_and_6_bit_blocks_decode_as_a_prompt_reads_them(wide_folder, tmp_path, march, monkeypatch):
    """The 5-bit (f16 and f32 scales) and 6-bit K group-blocks: a token stepped alone (each kernel's
    one-token path) gives the logits of the prompt's pass (the many-token path) to the bit, both within
    the activations' rounding of the dequantized file; a token reads 24 bytes a 32 values of Q5_0 and
    Q5_1, 28 of Q5_K and 32 of Q6_K (the file's 22, 24, 22 and 26.25, not 48 as 8-bit values were)."""
    from engines.native_gguf.model import NativeGGUF

    monkeypatch.setenv("OPTIMIZE_NATIVE_MARCH", march)
    path, dequantized = _write(wide_folder, tmp_path, packed)
    prompt_model, step_model = (NativeGGUF(path, context=256, kv_cache="f32") for _ in range(2))
    prompt = prompt_model.forward(IDS, 0).copy()
    steps = np.stack([step_model.step(token, position).copy() for position, token in enumerate(IDS)])
    np.testing.assert_array_equal(steps, prompt)
    reference = _reference_log_likelihoods(dequantized, IDS)
    np.testing.assert_allclose(_log_likelihoods(prompt_model, IDS), reference, atol=4e-4)
    five, five_k, six_k = 24, 28, 32  # bytes a row's 32 values
    per_layer = (256 * 256 + 128 * 256 + 2 * 512 * 256) * five + 256 * 256 * five_k + (128 * 256 + 256 * 512) * six_k
    assert prompt_model.weight_bytes_per_token == (2 * per_layer + 512 * 256 * five_k) // 32


@needs_kernels
@pytest.mark.parametrize("qtype, top", [("Q4_0", 0x7BFF), ("Q5_0", 0x7BFF), ("Q5_0", 0x6C00)])
def test_a_symmetric_scale_whose_offset_overflows_f16_is_one_line(folder, tmp_path, qtype, top):
    """Q4_0 and Q5_0 are carried as d * q + m with m = -8d or -16d in f16: a scale that makes m overflow
    (65504 for both; 4096 for Q5_0, whose 8 x 4096 would fit) is refused naming the tensor, not run as Inf."""
    import gguf

    from engines.native_gguf.model import NativeGGUF, NativeModelError
    from tests.support.gguf_writer import rewrite_gguf, write_gguf

    source = write_gguf(folder, tmp_path / "model.gguf", qtype)
    name = "blk.1.ffn_up.weight"
    raw = np.array(next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == name).data, dtype=np.uint8)
    raw[3, 0:2] = np.array([top], np.uint16).view(np.uint8)  # row 3's first block's f16 scale
    edited = rewrite_gguf(source, tmp_path / "edited.gguf", tensors={name: (raw, gguf.GGMLQuantizationType[qtype])})
    with pytest.raises(NativeModelError) as caught:
        NativeGGUF(edited, context=64)
    line = str(caught.value)
    assert "\n" not in line and name in line and f"{qtype} scale whose offset" in line and "overflows f16" in line


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("march", PATHS)
def test_qwen2_biases_and_half_rotation_compute_what_transformers_does(tmp_path, march, monkeypatch):
    """Qwen2 (llama.cpp's qwen2.* keys, q/k/v biases, each head's halves rotated): transformers' own
    model of the same Q8_0 file."""
    from engines.native_gguf.model import NativeGGUF
    from tests.support.tiny_archs import tiny_folder

    monkeypatch.setenv("OPTIMIZE_NATIVE_MARCH", march)
    folder = tiny_folder("qwen2", tmp_path / "hf")
    path, dequantized = _write(folder, tmp_path, "Q8_0")
    model = NativeGGUF(path, context=256, kv_cache="f32")
    assert model.hyper.neox
    ours, reference = _log_likelihoods(model, IDS), _reference_log_likelihoods(dequantized, IDS)
    np.testing.assert_allclose(ours, reference, atol=2e-4)
    assert abs(np.exp(-ours.mean()) / np.exp(-reference.mean()) - 1) < 1e-5


@needs_kernels
@pytest.mark.slow
def test_the_f16_kv_cache_halves_its_bytes_within_the_tolerance(folder, tmp_path):
    """The f16 cache (the default: half the bytes a token reads at long context) against the f32 one on
    the same file: log-likelihoods within 2e-4 of the dequantized file's still; a cache of another type
    is one line."""
    from engines.native_gguf.model import NativeGGUF, NativeModelError

    path, dequantized = _write(folder, tmp_path, "Q8_0")
    reference = _reference_log_likelihoods(dequantized, IDS)
    half, full = NativeGGUF(path, context=256), NativeGGUF(path, context=256, kv_cache="f32")
    assert (half.kv_bytes, full.kv_bytes) == (2, 4)
    np.testing.assert_allclose(_log_likelihoods(half, IDS), reference, atol=2e-4)
    np.testing.assert_allclose(_log_likelihoods(full, IDS), reference, atol=1e-4)
    with pytest.raises(NativeModelError, match="f16 or f32"):
        NativeGGUF(path, kv_cache="bf16")


def test_k_quant_rows_that_are_not_whole_super_blocks_and_a_missing_bias_are_one_line(folder, tmp_path):
    """Width 64: a Q4_K matrix of 64-value rows cannot be super-blocks of 256 (a header edited to say so);
    a Qwen2 file without a layer's k bias. Each one line."""
    import gguf

    from engines.gguf import CarryError, open_reader
    from engines.native_gguf import contract
    from engines.native_gguf.model import NativeModelError
    from tests.support.gguf_writer import edit_tensor_info, rewrite_gguf, write_gguf
    from tests.support.tiny_archs import tiny_folder

    source = write_gguf(folder, tmp_path / "q8.gguf", "Q8_0")
    q4_k = gguf.GGMLQuantizationType.Q4_K
    bad = rewrite_gguf(
        source, tmp_path / "short.gguf", tensors={"blk.0.attn_q.weight": (np.zeros((16, 144), np.uint8), q4_k)}
    )
    edit_tensor_info(bad, "blk.0.attn_q.weight", dims=[64, 64])  # 4096 values: 16 super-blocks' bytes
    with pytest.raises(CarryError, match="multiple of Q4_K block size"):  # the reader's own refusal
        contract.checked(open_reader(bad))
    qwen = write_gguf(tiny_folder("qwen2", tmp_path / "qwen2"), tmp_path / "qwen2.gguf", "Q8_0")
    unbiased = rewrite_gguf(qwen, tmp_path / "unbiased.gguf", tensors={"blk.1.attn_k.bias": None})
    with pytest.raises(NativeModelError, match="no blk.1.attn_k.bias"):
        contract.checked(open_reader(unbiased))


@needs_kernels
@pytest.mark.slow
def test_the_runner_generates_renders_and_samples_as_the_model_does(folder, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from engines.generation import Constraint, Sampling, UnsupportedSampling
    from engines.native_gguf.runner import NativeGGUFRunner

    path, dequantized = _write(folder, tmp_path, "Q8_0")
    runner = NativeGGUFRunner(_runner_folder(folder, path), path.name)
    messages = [{"role": "user", "content": "What does the with statement do?"}]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = runner.chat_prompt(messages)
    assert prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = runner.encode(prompt)
    assert ids == tokenizer(prompt, add_special_tokens=False).input_ids
    # Greedy: the dequantized model's own greedy tokens (EOS is token 0, which random weights rarely pick).
    ours = [token for token, _ in runner.generate(ids, Sampling(max_new_tokens=12))]
    with torch.no_grad():
        theirs = dequantized.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids) :].tolist()
    assert ours == theirs[: len(ours)] and len(ours) > 0
    assert runner.decode(ours) == tokenizer.decode(ours, skip_special_tokens=True)
    # Sampling: a seed gives the same tokens twice, another seed others; the settings that cut the
    # distribution to one token make it greedy again.
    warm = Sampling(max_new_tokens=12, temperature=1.5, seed=7, top_p=0.95, min_p=0.01, repetition_penalty=1.2)
    first = [t for t, _ in runner.generate(ids, warm)]
    assert first == [t for t, _ in runner.generate(ids, warm)]
    other = Sampling(max_new_tokens=12, temperature=1.5, seed=8, top_p=0.95, min_p=0.01, repetition_penalty=1.2)
    assert first != [t for t, _ in runner.generate(ids, other)]
    narrow = Sampling(max_new_tokens=12, temperature=1.0, seed=1, top_k=1)
    assert [t for t, _ in runner.generate(ids, narrow)] == ours
    logprobs = []
    list(runner.generate(ids, Sampling(max_new_tokens=3, logprobs=True, top_logprobs=2), on_logprob=logprobs.append))
    assert len(logprobs) == 3 and logprobs[0].token == ours[0] and logprobs[0].top[0][0] == ours[0]
    with pytest.raises(UnsupportedSampling, match="constraint"):
        list(runner.generate(ids, Sampling(max_new_tokens=2, constraint=Constraint("regex", "a+"))))
    # A prompt is read 64 tokens a pass (16 a kernel's tile): the same logits, to the bit, as one token a
    # step (150 tokens: 3 passes, the last of 22).
    long = IDS * 3 + IDS[:6]
    stepped = np.stack([runner.model.step(token, position).copy() for position, token in enumerate(long)])
    np.testing.assert_array_equal(runner.model.forward(long, 0), stepped)
    np.testing.assert_array_equal(runner.model.forward(long, 0, every=False), stepped[-1:])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.model.step(512, 0)
    with pytest.raises(ValueError, match="past the KV cache"):
        runner.model.forward(IDS, runner.context_length - 8)
    with pytest.raises(ValueError, match="empty prompt"):
        list(runner.generate([], Sampling(max_new_tokens=2)))
    # Timed decoding: one stamp a token, in order.
    stamps = runner.timed_stream(ids, 8)
    assert len(stamps) == 8 and stamps == sorted(stamps)


def test_what_it_cannot_carry_is_named_before_anything_is_repacked(folder, tmp_path):
    from engines.gguf import tensors
    from engines.native_gguf.model import NativeModelError, uncarried
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "f16.gguf", lambda name: "F16" if "ffn_up" in name else "Q8_0")
    reason = uncarried(*tensors(path))
    assert "blk.0.ffn_up.weight (F16), blk.1.ffn_up.weight (F16)" in reason and "Q4_0, Q4_1, Q8_0, Q5_0" in reason
    assert "not 'gemma2'" in uncarried("gemma2", tensors(path)[1])
    if build.unavailable() is None:
        from engines.native_gguf.model import NativeGGUF

        with pytest.raises(NativeModelError, match="ffn_up"):
            NativeGGUF(path)


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("llama.block_count", 5, "its header says 5 layers, its tensors number 2"),
        ("llama.attention.head_count", 0, "0 heads and 2 key/value heads do not divide width 64"),
        ("llama.feed_forward_length", 100, "its feed-forward width 100 is not a whole number of 32-wide blocks"),
        ("llama.context_length", 0, "its context length is 0"),
    ],
)
def test_a_header_the_kernels_cannot_run_is_named_before_anything_is_repacked(folder, tmp_path, key, value, says):
    """The file's own header edited in place (gguf's reader opened for writing): one line naming it."""
    from gguf import GGUFReader

    from engines.native_gguf.model import NativeGGUF, NativeModelError
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", "Q8_0")
    field = GGUFReader(str(path), "r+").fields[key]
    field.parts[field.data[0]][0] = value
    with pytest.raises(NativeModelError, match=says):
        NativeGGUF(path)


def test_a_cpu_without_avx2_is_refused_naming_what_it_lacks_and_avx512_vnni_takes_the_wider_path():
    zen3 = frozenset({"avx2", "fma", "f16c", "sse4_2"})
    assert build.unsupported_cpu(zen3, "x86_64") is None and build.path(zen3) == "AVX2"
    zen5 = zen3 | {"avx512f", "avx512bw", "avx512_vnni"}
    assert build.unsupported_cpu(zen5, "x86_64") is None and build.path(zen5) == "AVX-512 VNNI"
    old = frozenset({"sse4_2", "avx", "f16c"})
    assert build.unsupported_cpu(old, "x86_64") == (
        "the native GGUF kernels need AVX2 with FMA and F16C; this CPU lacks avx2, fma"
    )
    assert "aarch64" in build.unsupported_cpu(zen3, "aarch64")
