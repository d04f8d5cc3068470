"""Roofline arithmetic (optimize/evaluate/roofline.py) on tiny hand-made graphs, modules and configs,
and its rows in the causal-LM report."""

from __future__ import annotations

import numpy as np
import pytest

from optimize.evaluate import roofline as rl


def _onnx_model(tmp_path, tied: bool = False, external: bool = False):
    """Embedding [10, 4] fp32 gathered; a 4->8 fp32 MatMul; a MatMulNBits 8->6 (4 bits, block 16:
    packed [6, 1, 8] uint8 = 48 B, scales [6] fp32 = 24 B); GroupQueryAttention cos/sin caches
    [32, 2] fp32 (256 B each, read one position row: 8 B each); an LM head MatMul on the embedding
    when tied."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.zeros((10, 4), np.float32), "embed"),
        numpy_helper.from_array(np.zeros((4, 8), np.float32), "w1"),
        numpy_helper.from_array(np.zeros((6, 1, 8), np.uint8), "w2_q"),
        numpy_helper.from_array(np.zeros((6,), np.float32), "w2_scales"),
        numpy_helper.from_array(np.zeros((32, 2), np.float32), "cos_cache"),
        numpy_helper.from_array(np.zeros((32, 2), np.float32), "sin_cache"),
    ]
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["h0"]),
        helper.make_node("MatMul", ["h0", "w1"], ["h1"]),
        helper.make_node(
            "MatMulNBits", ["h1", "w2_q", "w2_scales"], ["h2"], domain="com.microsoft", K=8, N=6, bits=4, block_size=16
        ),
        helper.make_node(
            "GroupQueryAttention",
            ["h2", "", "", "past_key_values.0.key", "", "seqlens", "total", "cos_cache", "sin_cache"],
            ["h3"],
            domain="com.microsoft",
        ),
    ]
    if tied:
        nodes.append(helper.make_node("MatMul", ["h3", "embed_t"], ["logits"]))
        nodes.insert(0, helper.make_node("Transpose", ["embed"], ["embed_t"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "s"]),
            helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT16, [1, 2, "p", 4]),
        ],
        [helper.make_tensor_value_info("h3", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    path = tmp_path / "model.onnx"
    if external:
        onnx.save(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx.data",
            size_threshold=0,
        )
    else:
        onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("external", [False, True])
def test_onnx_weights_count_gathered_tables_one_row(tmp_path, external):
    weight = rl.onnx_weight_bytes(_onnx_model(tmp_path, external=external))
    assert weight.stored == 160 + 128 + 48 + 24 + 256 + 256
    # embedding: 1 row of 16 B; cos/sin: 1 row of 8 B each; everything else whole
    assert weight.per_token == 16 + 128 + 48 + 24 + 8 + 8
    assert weight.gathered_tables == ["cos_cache", "embed", "sin_cache"]
    assert rl.onnx_kv_dtype_bytes(tmp_path / "model.onnx") == 2


def test_onnx_tied_embedding_is_read_whole_once(tmp_path):
    weight = rl.onnx_weight_bytes(_onnx_model(tmp_path, tied=True))
    assert weight.per_token == 160 + 128 + 48 + 24 + 8 + 8
    assert weight.gathered_tables == ["cos_cache", "sin_cache"]


def test_torch_weights_untied_and_tied():
    import torch

    class LM(torch.nn.Module):
        def __init__(self, tied):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.proj = torch.nn.Linear(4, 8)  # 32 weights + 8 biases
            self.head = torch.nn.Linear(4, 10, bias=False)
            if tied:
                self.head.weight = self.embed.weight

    untied = rl.torch_weight_bytes(LM(False))
    assert untied.stored == (40 + 40 + 40) * 4
    assert untied.per_token == 4 * 4 + 40 * 4 + 40 * 4  # one embedding row, projection, head
    assert untied.gathered_tables == ["embed.weight"]
    tied = rl.torch_weight_bytes(LM(True))
    assert tied.stored == tied.per_token == (40 + 40) * 4  # the shared table once, whole (the head reads it)
    assert tied.gathered_tables == []
    assert rl.torch_weight_bytes(LM(False).half()).per_token == untied.per_token // 2


def test_kv_bytes_from_configs():
    genai = rl.kv_shape_from_genai_config(
        {"model": {"decoder": {"num_hidden_layers": 2, "num_key_value_heads": 3, "head_size": 8}}}, 4
    )
    assert genai.bytes_per_token(10) == 2 * 2 * 3 * 8 * 4 * 10 == 3840
    hf = rl.kv_shape_from_hf_config(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}, 4
    )
    assert (hf.head_dim, hf.kv_heads) == (64, 3)
    assert hf.bytes_per_token(96) == 30 * 2 * 3 * 64 * 4 * 96 == 4_423_680  # SmolLM2-135M, FP32, 96 tokens
    mha = rl.kv_shape_from_hf_config(
        {"num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 64, "head_dim": 32}, 2
    )
    assert (mha.kv_heads, mha.head_dim) == (4, 32)


def test_roofline_bound_and_share():
    weight = rl.WeightBytes(per_token=3_000_000, stored=5_000_000, source="x")
    kv = rl.KVShape(layers=1, kv_heads=1, head_dim=125, dtype_bytes=4)  # 1,000 B per cached token
    r = rl.roofline(weight, kv, context_tokens=1000, bandwidth_gb_s=20.0, decode_tok_s=2500.0)
    assert r["kv_bytes_per_token"] == 1_000_000
    assert r["bound_tok_s"] == pytest.approx(20e9 / 4e6) == 5000
    assert r["share"] == pytest.approx(0.5)
    assert rl.roofline(weight, kv, 1000, 20.0, None)["share"] is None
    unknown = rl.roofline(None, kv, 1000, 20.0, 10.0)
    assert unknown["bound_tok_s"] is None and unknown["share"] is None and "not known" in unknown["note"]


def test_runner_without_the_methods_is_not_known():
    class Opaque:
        pass

    class Failing:
        def weight_bytes_per_token(self):
            raise OSError("no files")

        def kv_shape(self):
            return rl.KVShape(1, 1, 1, 4)

    assert rl.runner_read_bytes(Opaque()) == (None, None)
    weight, kv = rl.runner_read_bytes(Failing())
    assert weight is None and kv.bytes_per_token(3) == 24


def test_read_bandwidth_is_quick_and_positive():
    import time

    start = time.perf_counter()
    result = rl.read_bandwidth(threads=2, budget_s=0.05, buffer_bytes=8 << 20, repeats=3)
    assert time.perf_counter() - start < 5
    assert result["bandwidth_gb_s"] > 0.1 and result["threads"] == 2 and 1 <= result["passes"] <= 3
    assert result["buffer_mb"] == pytest.approx(8.0)


OV_XML = """<?xml version="1.0"?>
<net name="m" version="11"><layers>
<layer id="0" name="ids" type="Parameter"><output><port id="0"/></output></layer>
<layer id="1" name="embed_u8" type="Const"><data element_type="u8" shape="100,8" offset="0" size="800"/>
  <output><port id="0"/></output></layer>
<layer id="2" name="cvt" type="Convert"><input><port id="0"/></input><output><port id="1"/></output></layer>
<layer id="3" name="embed_scale" type="Const"><data element_type="f16" shape="100,1" offset="800" size="200"/>
  <output><port id="0"/></output></layer>
<layer id="4" name="mul" type="Multiply"><input><port id="0"/><port id="1"/></input>
  <output><port id="2"/></output></layer>
<layer id="5" name="axis" type="Const"><data element_type="i64" shape="" offset="1000" size="8"/>
  <output><port id="0"/></output></layer>
<layer id="6" name="gather" type="Gather"><input><port id="0"/><port id="1"/><port id="2"/></input>
  <output><port id="3"/></output></layer>
<layer id="7" name="w" type="Const"><data element_type="f32" shape="8,8" offset="1008" size="256"/>
  <output><port id="0"/></output></layer>
<layer id="8" name="mm" type="MatMul"><input><port id="0"/><port id="1"/></input><output><port id="2"/></output></layer>
</layers><edges>
<edge from-layer="1" from-port="0" to-layer="2" to-port="0"/>
<edge from-layer="2" from-port="1" to-layer="4" to-port="0"/>
<edge from-layer="3" from-port="0" to-layer="4" to-port="1"/>
<edge from-layer="4" from-port="2" to-layer="6" to-port="0"/>
<edge from-layer="0" from-port="0" to-layer="6" to-port="1"/>
<edge from-layer="5" from-port="0" to-layer="6" to-port="2"/>
<edge from-layer="6" from-port="3" to-layer="8" to-port="0"/>
<edge from-layer="7" from-port="0" to-layer="8" to-port="1"/>
</edges></net>"""


def test_openvino_ir_gathered_through_decompression(tmp_path):
    path = tmp_path / "openvino_model.xml"
    path.write_text(OV_XML)
    weight = rl.openvino_weight_bytes(path)
    assert weight.stored == 800 + 200 + 8 + 256
    # the u8 table and its scales reach only Gather's data input: one row each (8 B + 2 B);
    # the axis constant feeds Gather's axis input: whole
    assert weight.per_token == 8 + 2 + 8 + 256
    assert weight.gathered_tables == ["embed_scale", "embed_u8"]


def test_openvino_tied_constants_share_one_span_read_whole(tmp_path):
    """Two Const layers over the same bytes of the .bin (an embedding tied to the LM head): read once,
    and whole, since the MatMul reads all of it."""
    tied = OV_XML.replace(
        'name="w" type="Const"><data element_type="f32" shape="8,8" offset="1008" size="256"',
        'name="head" type="Const"><data element_type="u8" shape="100,8" offset="0" size="800"',
    )
    folder = tmp_path / "ov"
    folder.mkdir()
    (folder / "openvino_model.xml").write_text(tied)
    (folder / "config.json").write_text(
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}'
    )
    weight = rl.openvino_weight_bytes(folder / "openvino_model.xml")
    assert weight.stored == 800 + 200 + 8
    assert weight.per_token == 800 + 2 + 8  # the table whole (the head reads it), one row of its scales
    assert weight.gathered_tables == ["embed_scale"]

    class OVRunner:  # a runner that cannot tell, with an OpenVINO GenAI folder and a u8 KV cache
        dir = folder
        properties = {"KV_CACHE_PRECISION": "u8"}

    w, kv = rl.runner_read_bytes(OVRunner())
    assert w.per_token == 810 and kv == rl.KVShape(layers=2, kv_heads=2, head_dim=8, dtype_bytes=1)


def _metrics(with_base_roofline: bool):
    bw = {"bandwidth_gb_s": 20.0, "threads": 2, "other_cpu_share": 0.1}
    cand = rl.roofline(rl.WeightBytes(90_000_000, 100_000_000), rl.KVShape(30, 3, 64, 4), 96, 20.0, 80.0)
    base = (
        rl.roofline(rl.WeightBytes(540_000_000, 540_000_000), rl.KVShape(30, 3, 64, 4), 96, 20.0, 10.0)
        if with_base_roofline
        else rl.roofline(None, None, 96, 20.0, 10.0)
    )
    sample = {"sample": {"continuation": "Rome"}}
    return {
        "baseline": {"perplexity": 18.0, **sample, "roofline": {**base, "bandwidth": bw}},
        "candidate": {
            "perplexity": 20.0,
            "perplexity_increase_pct": 11.1,
            **sample,
            "roofline": {**cand, "bandwidth": bw},
        },
    }


def test_report_rows():
    from optimize.tasks.causal_lm_rows import table_rows

    rows = {r[0]: r[1:] for r in table_rows(_metrics(True))}
    assert rows["weights read per token MB"] == ["540.0", "90.0", "0.17x"]
    assert rows["KV cache read per token MB (96 tokens)"] == ["4.4", "4.4", ""]
    assert rows["memory read bandwidth GB/s (measured)"][:2] == ["20.0", "20.0"]
    assert "others 10% CPU" in rows["memory read bandwidth GB/s (measured)"][2]
    # 20e9 / (90e6 + 4,423,680) = 211.8 tok/s; 80 / 211.8 = 38%
    assert rows["roofline bound decode tok/s"][1] == "211.8"
    assert rows["decode p50 share of bound"] == [
        "27%",
        "38%",
        "not memory-bound: compute and per-token overhead limit decode",
    ]
    unknown = {r[0]: r[1:] for r in table_rows(_metrics(False))}
    assert unknown["weights read per token MB"][0] == "not known"
    assert unknown["roofline bound decode tok/s"][0] == "not known"
    assert unknown["decode p50 share of bound"][0] == "not known"


@pytest.mark.slow
def test_genai_and_torch_runners_tell_the_same_reads(tmp_path):
    """The tiny Llama (2 layers, 2 KV heads of 16, tied 512 x 64 embedding) built FP32 by the GenAI
    builder reads the torch parameters plus one row each of the rotary cos/sin caches."""
    from transformers import AutoModelForCausalLM

    from engines.onnxruntime_genai.build import build
    from engines.onnxruntime_genai.runner import GenAIRunner
    from engines.pytorch.runner import TorchLM
    from tests.support.models import tiny_llama_folder

    src = tiny_llama_folder(tmp_path / "src")
    build(src, tmp_path / "genai", "fp32", "cpu", [], tmp_path / "cache")
    genai, torch_lm = GenAIRunner(tmp_path / "genai"), TorchLM(AutoModelForCausalLM.from_pretrained(str(src)))
    assert genai.kv_shape() == torch_lm.kv_shape() == rl.KVShape(layers=2, kv_heads=2, head_dim=16, dtype_bytes=4)
    g, t = genai.weight_bytes_per_token(), torch_lm.weight_bytes_per_token()
    assert t.per_token == t.stored  # tied embedding: the LM head reads it whole
    assert g.gathered_tables == ["cos_cache", "sin_cache"]
    assert g.per_token == t.per_token + 2 * (16 // 2) * 4  # one position row of cos and of sin, FP32
    assert g.stored == t.stored + 2 * 512 * (16 // 2) * 4  # the caches hold 512 positions
