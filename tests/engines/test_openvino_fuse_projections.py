"""engines/openvino/fuse_projections.py on a tiny Llama's IR: each layer's q, k, v and its gate, up
become one MatMul with a VariadicSplit, for FP32, INT8 per channel and INT4 in groups (u4 constants
joined as packed bytes); the logits and greedy tokens stay the unfused IR's; a layer whose members
differ (one left at f32 beside INT8 ones) keeps them apart and is counted; the engine stage records it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("openvino", "openvino_genai", "nncf")),
    reason="needs openvino, openvino-genai and nncf",
)


@pytest.fixture(scope="module")
def ov_fp32(tmp_path_factory) -> Path:
    from engines.openvino.genai_build import export_stateful_lm
    from tests.engines.test_openvino_genai import varied_llama_folder

    root = tmp_path_factory.mktemp("fuse")
    return export_stateful_lm(varied_llama_folder(root / "src"), root / "fp32")


def _logits(xml: Path, ids: list[int]) -> np.ndarray:
    """One pass of the stateful IR over `ids` from an empty cache: the logits of every position."""
    import openvino as ov

    request = ov.Core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    n = len(ids)
    request.infer(
        {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, np.int32),
        }
    )
    return request.get_tensor("logits").data[0].copy()


def _fused_copy(xml: Path, out: Path):
    """(the fused IR's path, the counts)."""
    import openvino as ov

    from engines.openvino.fuse_projections import fuse_projections
    from engines.openvino.genai_build import save_ir

    model = ov.Core().read_model(str(xml))
    counts = fuse_projections(model)
    return save_ir(model, out), counts


def _matmuls(xml: Path) -> list[str]:
    import openvino as ov

    return [
        o.get_friendly_name() for o in ov.Core().read_model(str(xml)).get_ordered_ops() if o.get_type_name() == "MatMul"
    ]


@pytest.mark.parametrize("mode", ["fp32", "int8_asym", "int4_asym"])
def test_fused_projections_compute_the_same_logits(ov_fp32, tmp_path, mode):
    from engines.openvino.genai_compress import compress_weights, weight_precision

    xml = ov_fp32 if mode == "fp32" else compress_weights(ov_fp32, tmp_path / mode, mode=mode, group_size=32)
    fused, counts = _fused_copy(xml, tmp_path / "fused")
    assert counts.record() == {"groups": 4, "fused": 4}  # 2 layers: qkv, gate_up
    names = _matmuls(fused)
    assert sum("qkv_proj" in n for n in names) == sum("gate_up_proj" in n for n in names) == 2
    assert not [n for n in names if re.search(r"\.(q|k|v|gate|up)_proj/", n)]
    assert len(names) == len(_matmuls(xml)) - 2 * 3  # 7 projections a layer became 4
    kind = {"fp32": "float", "int8_asym": "int8", "int4_asym": "int4"}[mode]
    assert "layers.1/self_attn/qkv_proj" in weight_precision(fused)[kind]["nodes"]
    ids = [int(i) for i in np.random.default_rng(0).integers(1, 500, 24)]
    np.testing.assert_allclose(_logits(fused, ids), _logits(xml, ids), rtol=1e-4, atol=1e-4)


def test_members_of_different_precision_stay_apart(ov_fp32, tmp_path):
    """Layer 0's k_proj left at f32 beside INT8 q and v: there q and v are fused and k stays apart."""
    from engines.openvino.genai_compress import compress_weights

    k0 = "__module.lm.model.layers.0.self_attn.k_proj/aten::linear/MatMul"
    assert k0 in _matmuls(ov_fp32)
    xml = compress_weights(ov_fp32, tmp_path / "int8", mode="int8_asym", ignored_scope={"names": [k0]})
    fused, counts = _fused_copy(xml, tmp_path / "fused")
    assert counts.record() == {"groups": 4, "fused": 4}
    names = _matmuls(fused)
    assert k0 in names and "__module.lm.model.layers.1.self_attn.qkv_proj/aten::linear/MatMul" in names
    q0, v0 = (k0.replace("k_proj", part) for part in ("q_proj", "v_proj"))
    assert f"{q0}+{v0}" in names or f"{v0}+{q0}" in names
    ids = [int(i) for i in np.random.default_rng(1).integers(1, 500, 16)]
    np.testing.assert_allclose(_logits(fused, ids), _logits(xml, ids), rtol=1e-4, atol=1e-4)


def test_the_continuous_batching_pipeline_decodes_the_same_tokens(ov_fp32, tmp_path):
    """The served engine (OpenVINO GenAI's continuous-batching pipeline) on the fused INT4 IR: the
    unfused IR's greedy tokens."""
    import shutil

    import openvino_genai

    from engines.openvino.genai_compress import compress_weights

    xml = compress_weights(ov_fp32, tmp_path / "int4", mode="int4_asym", group_size=32)
    fused_dir = tmp_path / "fused"
    shutil.copytree(xml.parent, fused_dir)
    fused, _ = _fused_copy(xml, tmp_path / "staged")
    for path in (fused, fused.with_suffix(".bin")):
        path.replace(fused_dir / path.name)
    tokens = []
    for folder in (xml.parent, fused_dir):
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.num_kv_blocks, scheduler.cache_size, scheduler.max_num_seqs = 64, 0, 4
        pipe = openvino_genai.ContinuousBatchingPipeline(
            str(folder), scheduler, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
        )
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens, config.do_sample = 24, False
        results = pipe.generate(["The return statement", "A class definition creates"], [config, config])
        tokens.append([r.m_generation_ids for r in results])
    assert tokens[0] == tokens[1]
