"""A GGUF file's blocks carried into ONNX Runtime GenAI's MatMulNBits weights
(engines/onnxruntime_genai/gguf.py): the builder's decoder from the file dequantized, its layer
weights then the file's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K blocks, scored against the file dequantized
by transformers (the pipeline's baseline): equal within f32 numerics for each type and for files
mixing them (Q4_K beside Q6_K as Q4_K_M files mix them, Q, K and V then unfused); each type's
MatMulNBits arrays hold the values gguf dequantizes; a fused matrix of two bit widths and a type with
no exact form are refused, naming the tensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "onnxruntime_genai")),
    reason="needs gguf and onnxruntime-genai",
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from tests.support.models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """Width 256: every matrix fills K-quant super-blocks (narrower rows fall back to Q5_0 / Q8_0)."""
    from tests.support.models import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("wide_llama"), max_positions=256, hidden=256, ffn=256)


def mixed(name: str) -> str:
    """Each matrix kind its own type; Q and K (fused with V into one qkv_proj) of two 4-bit types."""
    for part, kind in (("attn_q", "Q4_1"), ("attn_k", "Q4_0"), ("ffn_down", "Q8_0"), ("token_embd", "Q8_0")):
        if part in name:
            return kind
    return "Q4_1"


def q4_k_m(name: str) -> str:
    """As llama.cpp's Q4_K_M mixes types: V and down 6-bit (Q6_K), the rest Q4_K; the tied embedding
    Q6_K too (the LM head of such files), so the head stays f32 with f32 activations."""
    return "Q6_K" if any(part in name for part in ("attn_v", "ffn_down", "token_embd")) else "Q4_K"


def _build(
    folder: Path,
    tmp_path: Path,
    qtype,
    accuracy_level: int = 1,
    options: list[str] | None = None,
    head_accuracy_level: int | None = None,
    offset_form: str = "block_sums",
    grid: dict | None = None,
):
    """(the GGUF path, the carried model's folder, the carried counts, the file dequantized). The
    builder's options are the file's (carry.builder_options) unless given."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines import gguf as genai_gguf
    from engines.onnxruntime_genai import gguf as carry
    from engines.onnxruntime_genai.build import build
    from optimize.sources.models import save_converted
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", qtype)
    if options is None:
        options = carry.builder_options(genai_gguf.tensors(path)[1])
    dequantized = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    save_converted(dequantized, tmp_path, "model.gguf", tmp_path / "dequantized", "test")
    out = tmp_path / "ort" / "genai"
    options = ["block_size=32", f"accuracy_level={accuracy_level}", *options]
    build(tmp_path / "dequantized", out, "int4", "cpu", options, tmp_path / "cache")
    carried = carry.carry_blocks(path, out / "model.onnx", accuracy_level, head_accuracy_level, offset_form, grid)
    return path, out, carried, dequantized


def _log_likelihoods(out: Path, dequantized) -> tuple[np.ndarray, np.ndarray]:
    """Per-token log-likelihoods of 48 random tokens: (the carried model's, the dequantized file's)."""
    import torch

    from engines.onnxruntime_genai.runner import GenAIRunner

    ids = [int(i) for i in np.random.default_rng(0).integers(1, 500, 48)]
    ours = np.asarray(GenAIRunner(out).log_likelihood(ids))
    with torch.no_grad():
        logits = dequantized(torch.tensor([ids])).logits[0].double()
    reference = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    return ours, reference


def _assert_equal_to_the_dequantized_file(out: Path, dequantized, atol: float = 1e-4) -> None:
    """The carried model's log-likelihoods against the dequantized file: equal to f32 rounding (1e-6
    seen) unless told otherwise."""
    np.testing.assert_allclose(*_log_likelihoods(out, dequantized), atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "mixed"])
def test_carried_blocks_compute_what_the_dequantized_file_does(folder, tmp_path, qtype):
    """Equal to the dequantized file; every layer matrix carried, the embedding f32, the (tied) LM head
    the file's blocks where they are 4-bit (Q4_0, Q4_1), f32 where Q8_0 (mixed: token_embd Q8_0)."""
    from engines.onnxruntime_genai.build import weight_precision

    _, out, carried, dequantized = _build(folder, tmp_path, mixed if qtype == "mixed" else qtype)
    _assert_equal_to_the_dequantized_file(out, dequantized)
    head_carried = qtype in ("Q4_0", "Q4_1")
    assert sum(carried.values()) == 2 * 7 + head_carried  # 2 layers of q, k, v, o, gate, up, down
    if qtype == "mixed":
        assert carried == {"Q4_1": 10, "Q4_0": 2, "Q8_0": 2}  # q, v, o, gate, up; k; down
    else:
        assert carried == {qtype: 14 + head_carried}
    layers = weight_precision(out / "model.onnx")
    assert layers["float"]["nodes"] == ["embed_tokens/Gather"] + ([] if head_carried else ["lm_head"]), layers
    # Per layer one MatMulNBits each for qkv, o, gate_up (gate and up fused) and down.
    kind = "int4" if qtype != "Q8_0" else "int8"
    assert layers[kind]["count"] == 8 - (2 if qtype == "mixed" else 0) + head_carried
    assert "layers.1/mlp/gate_up_proj" in layers[kind]["nodes"]


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_K_M"])
def test_k_quant_blocks_compute_what_the_dequantized_file_does(wide, tmp_path, qtype):
    """Q4_K everywhere: fused Q, K and V (and gate and up), the tied LM head its 4-bit blocks. Q4_K_M's
    mix: Q, K and V unfused (V 8-bit beside 4-bit Q and K), gate and up fused, V and down 8-bit blocks
    of 16, the Q6_K head f32."""
    from engines import gguf as genai_gguf
    from engines.onnxruntime_genai import gguf as carry
    from engines.onnxruntime_genai.build import weight_precision

    path, out, carried, dequantized = _build(wide, tmp_path, q4_k_m if qtype == "Q4_K_M" else qtype)
    _assert_equal_to_the_dequantized_file(out, dequantized)
    layers = weight_precision(out / "model.onnx")
    if qtype == "Q4_K":
        assert carried == {"Q4_K": 15}
        assert layers["int4"]["count"] == 9 and layers["float"]["nodes"] == ["embed_tokens/Gather"], layers
    else:
        assert carried == {"Q4_K": 10, "Q6_K": 4}  # q, k, o, gate, up; v, down
        assert layers["int4"]["count"] == 8 and layers["float"]["nodes"] == ["embed_tokens/Gather", "lm_head"]
        eight_bit = [f"layers.{i}/{node}" for i in (0, 1) for node in ("attn/v_proj", "mlp/down_proj")]
        assert layers["int8"]["nodes"] == eight_bit, layers
        became = carry.became(genai_gguf.tensors(path)[1], 1)
        assert became["Q4_K"] == carry.CARRIED["Q4_K"]
        assert became["Q6_K"] == f"{carry.CARRIED['Q6_K']}; token_embd.weight: {carry.NOT_CARRIED}"


def test_the_matmul_nbits_arrays_hold_the_values_gguf_dequantizes(tmp_path):
    """Each carried type's MatMulNBits arrays (B, zero points, scales, offsets), unpacked here as the
    kernel reads them, against gguf.quants.dequantize: equal bit for bit (K-quants' nibble and
    scale layouts included); Q8_0 split into blocks of 16 (to sit beside Q6_K) the same."""
    import gguf

    from engines.onnxruntime_genai import gguf as carry
    from tests.support.gguf_writer import q4_k_blocks, q6_k_blocks

    data = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    path = tmp_path / "matrices.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    own = {"Q4_K": q4_k_blocks, "Q6_K": q6_k_blocks}
    for kind in carry.CARRIED:
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        packed = own[kind](data) if kind in own else gguf.quants.quantize(data, qtype)
        writer.add_tensor(kind, packed, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for t in gguf.GGUFReader(str(path)).tensors:
        arrays = carry._as_matmul_nbits(t, None)
        reference = gguf.quants.dequantize(t.data, t.tensor_type).reshape(data.shape)
        np.testing.assert_array_equal(_unpacked(arrays), reference, err_msg=t.name)
        assert arrays["block"] == (16 if t.name == "Q6_K" else 32) and arrays["bits"] == carry.BITS[t.name]
        if t.name == "Q8_0":
            np.testing.assert_array_equal(_unpacked(carry._reblocked(arrays, 16)), reference)


def _unpacked(arrays: dict) -> np.ndarray:
    """MatMulNBits arrays -> the [N, K] weights they stand for: (q - zero point) * scale + offset."""
    B = arrays["B"]
    q = np.stack([B & 0x0F, B >> 4], axis=-1).reshape(*B.shape[:2], -1) if arrays["bits"] == 4 else B
    w = (q.astype(np.float32) - arrays["zero"][..., None]) * arrays["scales"][..., None] + arrays["offset"][..., None]
    return w.reshape(len(B), -1)


@pytest.mark.slow
def test_a_qwen2_file_is_carried_too(tmp_path):
    """Qwen2 (biases on Q, K and V, rows not permuted by llama.cpp): equal to the dequantized file."""
    from tests.support.tiny_archs import tiny_folder

    _, out, carried, dequantized = _build(tiny_folder("qwen2", tmp_path / "hf"), tmp_path, "Q4_1")
    _assert_equal_to_the_dequantized_file(out, dequantized)
    assert carried == {"Q4_1": 15}  # the tied LM head too


@pytest.mark.slow
def test_a_fused_matrix_of_two_bit_widths_is_refused(folder, tmp_path):
    """V at 8 bits beside Q and K at 4, built fused (builder_options unfuses such files): the one
    qkv_proj cannot hold both; named."""
    from engines.gguf import CarryError
    from engines.onnxruntime_genai import gguf as carry

    with pytest.raises(
        CarryError, match=r"qkv_proj/MatMul_Q4 fuses blk\.0\.attn_q\.weight \(Q4_0\).*attn_v\.weight \(Q8_0\)"
    ):
        _build(folder, tmp_path, lambda name: "Q8_0" if "attn_v" in name else "Q4_0", options=carry.BUILDER_OPTIONS)


def test_a_type_with_no_exact_form_is_named(folder, tmp_path):
    """Q5_0 layer matrices are named before anything is built; a Q5_0 embedding would not be (it stays f32)."""
    from engines import gguf as genai_gguf
    from engines.onnxruntime_genai import gguf as carry
    from tests.support.gguf_writer import write_gguf

    path = write_gguf(folder, tmp_path / "model.gguf", lambda name: "Q5_0" if "ffn_up" in name else "Q8_0")
    architecture, tensors = genai_gguf.tensors(path)
    assert carry.uncarried(architecture, tensors) == (
        "MatMulNBits has no exact form of these tensors' types: blk.0.ffn_up.weight (Q5_0), blk.1.ffn_up.weight (Q5_0)"
    )
    became = carry.became(tensors, 1)
    assert became["Q8_0"].startswith("MatMulNBits bits 8") and became["Q8_0"].endswith(
        "token_embd.weight: f32, dequantized from the file by the builder (the file's values, not its blocks)"
    )
    assert carry.uncarried(architecture, [t for t in tensors if t.type != "Q5_0"]) is None


@pytest.mark.slow
def test_a_q8_0_lm_head_is_carried_with_int8_activations(folder, tmp_path):
    """Q8_0 embedding at accuracy_level 4: the LM head 8-bit blocks (the CPU's fast 8-bit path); at
    accuracy_level 1 it stays f32 (the other tests)."""
    from engines.onnxruntime_genai.build import weight_precision
    from engines.onnxruntime_genai.runner import GenAIRunner

    _, out, carried, _ = _build(folder, tmp_path, lambda name: "Q8_0" if "token_embd" in name else "Q4_0", 4)
    assert carried == {"Q4_0": 14, "Q8_0": 1}
    assert weight_precision(out / "model.onnx")["int8"]["nodes"] == ["lm_head"]
    assert np.isfinite(GenAIRunner(out).log_likelihood(list(range(1, 20)))).all()


@pytest.mark.slow
def test_an_8_bit_head_alone_takes_int8_activations_and_the_layers_stay_exact(folder, tmp_path):
    """head_accuracy_level 4 with the layers at 1: the Q8_0 head carried as blocks with INT8
    activations for that MatMul only; every layer MatMul keeps f32 activations; the log-likelihoods
    stay within the head's activation rounding of the dequantized file's."""
    import onnx
    from onnx import helper

    from engines import gguf as genai_gguf
    from engines.onnxruntime_genai import gguf as carry

    def kinds(name):
        return "Q8_0" if "token_embd" in name else "Q4_1"

    path, out, carried, dequantized = _build(folder, tmp_path, kinds, 1, head_accuracy_level=4)
    assert carried == {"Q4_1": 14, "Q8_0": 1}
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    levels = {
        n.name: next(helper.get_attribute_value(a) for a in n.attribute if a.name == "accuracy_level")
        for n in graph.node
        if n.op_type == "MatMulNBits"
    }
    assert levels.pop(carry.LM_HEAD) == 4 and set(levels.values()) == {1}
    became = carry.became(genai_gguf.tensors(path)[1], 1, 4)
    assert became["Q8_0"].startswith(carry.CARRIED["Q8_0"])
    # Within the head's INT8 activation rounding (equal where a CPU's kernel keeps f32 for 8-bit weights).
    _assert_equal_to_the_dequantized_file(out, dequantized, atol=0.05)


def test_centred_zero_points_keep_the_weights_and_leave_a_residual_of_half_a_step(tmp_path):
    """Q4_1's form rebased on the nearest integer zero point: the same weights to f32 rounding, zero
    points within 4 bits, each block's remaining offset at most half its scale where -m / d lies in
    0..15 (a block spanning zero), and a zero scale left as it was."""
    from engines.onnxruntime_genai import gguf as carry

    data = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    data[0, :32] = 0.0  # a block of zeros: scale 0
    data[1, :32] = np.linspace(1.0, 2.0, 32)  # a block all above zero: -m / d below 0, clipped
    arrays = carry._as_matmul_nbits(_one_tensor(tmp_path, "Q4_1", data), None)
    centred = carry._centred(arrays)
    np.testing.assert_allclose(_unpacked(centred), _unpacked(arrays), rtol=1e-6, atol=1e-6)
    assert centred["zero"].dtype == np.uint8 and centred["zero"].max() <= 15
    assert (arrays["zero"] == 0).all() and centred["zero"].mean() > 4  # blocks spanning zero sit mid-range
    spans = (-arrays["offset"] >= 0) & (-arrays["offset"] <= 15 * arrays["scales"])
    assert (np.abs(centred["offset"][spans]) <= arrays["scales"][spans] / 2 + 1e-6).all()
    assert centred["zero"][0, 0] == 0 and centred["zero"][1, 0] == 0  # zero scale; all above zero
    np.testing.assert_array_equal(centred["offset"][1, 0], arrays["offset"][1, 0])


@pytest.mark.slow
def test_int8_activations_meet_q4_1_blocks_on_centred_zero_points(folder, tmp_path, monkeypatch):
    """Every layer at accuracy_level 4 on a Q4_1 file: with the zero points centred the log-likelihoods
    stay within INT8 activation rounding of the dequantized file, and nearer to it (0.65x on average) than
    the same blocks on zero point 0 (where the rounding multiplies the uncentred 0..15)."""
    from engines.onnxruntime_genai import gguf as carry

    (tmp_path / "centred").mkdir(), (tmp_path / "uncentred").mkdir()
    _, out, carried, dequantized = _build(folder, tmp_path / "centred", "Q4_1", 4)
    assert carried == {"Q4_1": 15}
    centred = np.abs(np.subtract(*_log_likelihoods(out, dequantized)))
    monkeypatch.setattr(carry, "_centred", lambda weights: weights)
    _, out, _, _ = _build(folder, tmp_path / "uncentred", "Q4_1", 4)
    uncentred = np.abs(np.subtract(*_log_likelihoods(out, dequantized)))
    assert centred.max() < 0.05, centred.max()
    assert centred.mean() < 0.8 * uncentred.mean(), (centred.mean(), uncentred.mean())  # 0.65x seen


def _one_tensor(tmp_path: Path, kind: str, data: np.ndarray):
    """`data` written as one GGUF tensor of `kind` (Q4_1 by gguf's quantizer, Q4_K by the tests' own),
    read back."""
    import gguf

    from tests.support.gguf_writer import q4_k_blocks

    path = tmp_path / f"{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    writer.add_tensor(kind, q4_k_blocks(data) if kind == "Q4_K" else gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path)).tensors[0]


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_offset_blocks_on_the_int8_grid_stay_within_a_32nd_of_a_step(tmp_path, kind):
    """offset_form int8_grid: Q4_1's and Q4_K's blocks (4 bits and an offset) become 8-bit blocks with
    no offset: every weight within d / (2k) of the file's, k = 16 (1/32 of a step) for every block whose
    offset lies within its range; a block of scale 0 exact; a block all above zero on a coarser grid
    that still fits 8 bits; each grid counted."""
    from engines.onnxruntime_genai import gguf as carry

    data = np.random.default_rng(2).standard_normal((8, 256)).astype(np.float32)
    data[0, :32] = 0.0  # scale 0, offset 0
    data[2, 32:64] = 0.75  # scale 0, offset 0.75: one value
    data[1, :32] = np.linspace(1.0, 2.0, 32)  # all above zero: -m / d = -15
    arrays = carry._as_matmul_nbits(_one_tensor(tmp_path, kind, data), None)
    grid: dict[int, int] = {}
    on_grid = carry._on_grid(arrays, "q", grid)
    assert on_grid["bits"] == 8 and on_grid["B"].dtype == np.uint8 and on_grid["zero"].dtype == np.uint8
    assert not on_grid["offset"].any()
    file_weights, grid_weights = _unpacked(arrays), _unpacked(on_grid)
    steps = np.repeat(arrays["scales"], 32, axis=1)
    error = np.abs(grid_weights - file_weights)
    spans = np.repeat((-arrays["offset"] >= 0) & (-arrays["offset"] <= 15 * arrays["scales"]), 32, axis=1)
    assert (error[spans] <= steps[spans] / 32 + 1e-6).all(), (error[spans] / steps[spans].clip(1e-12)).max()
    assert (error <= steps / 2 + 1e-6).all()
    if kind == "Q4_1":
        np.testing.assert_array_equal(grid_weights[0, :32], 0.0)
        np.testing.assert_allclose(grid_weights[2, 32:64], file_weights[2, 32:64], rtol=1e-6)
        assert (error[1, :32] <= steps[1, :32] / 16 + 1e-6).all()  # -m / d = -15: k = 8 fits 8 bits
    assert sum(grid.values()) == arrays["scales"].size and grid[16] > 0.9 * arrays["scales"].size


def test_an_offset_beyond_the_int8_grid_is_refused_naming_the_matrix(tmp_path):
    """A block whose values sit far from zero against their spread (-m / d about -15,000) has no 8-bit
    form with a zero point in 0..255: refused, naming the matrix and the form that carries it."""
    from engines.gguf import CarryError
    from engines.onnxruntime_genai import gguf as carry

    data = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    data[0, :32] = np.linspace(100.0, 100.1, 32)
    arrays = carry._as_matmul_nbits(_one_tensor(tmp_path, "Q4_1", data), None)
    with pytest.raises(
        CarryError,
        match=r"layers\.0/mlp/up_proj/MatMul_Q4: 1 block\(s\) with an offset beyond .* offset_form=block_sums",
    ):
        carry._on_grid(arrays, "/model/layers.0/mlp/up_proj/MatMul_Q4")


@pytest.mark.slow
def test_q4_1_on_the_int8_grid_adds_no_nodes_and_keeps_the_files_log_likelihoods(folder, tmp_path):
    """The whole carry at offset_form int8_grid, accuracy_level 4: every layer MatMulNBits 8-bit, no
    offset node in the graph, every block on the 16-step grid, and log-likelihoods within INT8
    activation rounding of the dequantized file."""
    import onnx

    from engines import gguf as genai_gguf
    from engines.onnxruntime_genai import gguf as carry
    from engines.onnxruntime_genai.build import OFFSET_SCOPE

    grid: dict[int, int] = {}
    path, out, carried, dequantized = _build(folder, tmp_path, "Q4_1", 4, offset_form="int8_grid", grid=grid)
    assert carried == {"Q4_1": 15}
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert not [n.name for n in graph.node if OFFSET_SCOPE in n.name]
    bits = {next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"}
    assert bits == {8}
    assert set(grid) == {16}
    assert carry.became(genai_gguf.tensors(path)[1], 4, None, "int8_grid")["Q4_1"].startswith(carry.GRID["Q4_1"])
    _assert_equal_to_the_dequantized_file(out, dequantized, atol=0.05)


def test_int8_grid_needs_int8_activations_and_a_known_form():
    """The recipe's refusals: int8_grid at accuracy_level 1 (8-bit weights have no fast path with f32
    activations), an unknown form; the stage's list of forms is the carry's."""
    from engines.onnxruntime_genai import gguf as carry
    from optimize.compile.onnxruntime_genai_gguf import OFFSET_FORMS, GenAIGGUFConfig
    from optimize.errors import RecipeError

    assert OFFSET_FORMS == carry.OFFSET_FORMS
    with pytest.raises(RecipeError, match="offset_form=int8_grid needs engine.params.accuracy_level=4"):
        GenAIGGUFConfig(offset_form="int8_grid").validate()
    with pytest.raises(RecipeError, match="offset_form=int4"):
        GenAIGGUFConfig(accuracy_level=4, offset_form="int4").validate()
    GenAIGGUFConfig(accuracy_level=4, offset_form="int8_grid").validate()


def test_the_builder_fuses_gate_and_up_and_qkv_unless_a_layer_holds_them_at_two_widths():
    from engines.gguf import GGUFTensor
    from engines.onnxruntime_genai import gguf as carry

    def tensors(types: dict[str, str]) -> list:
        return [GGUFTensor(f"blk.0.{part}.weight", kind, (64, 64)) for part, kind in types.items()]

    uniform = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q4_1", "ffn_gate": "Q4_1", "ffn_up": "Q4_1"}
    assert carry.builder_options(tensors(uniform)) == [*carry.BUILDER_OPTIONS, "fuse_mlp_gate_up=true"]
    q4_k_m = {**uniform, "attn_v": "Q6_K", "ffn_up": "Q6_K"}
    assert carry.builder_options(tensors(q4_k_m)) == [*carry.BUILDER_OPTIONS, "fuse_qkv=false"]
