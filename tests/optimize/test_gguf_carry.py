"""A quantized source stays quantized: a GGUF file through the real command line, the race offered the
candidate that keeps its blocks (engine openvino_genai_gguf) beside one quantized again; the manifest
records the weights as in the source with the file's own types, the report says what the baseline is,
and gate.max_ppl_increase_over_source_pct judges against it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engines.native_gguf import build as native_build
from tests.support.cli import TINY_LM_RACE, one_error_line, run_optimize

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("gguf", "openvino", "openvino_genai", "openvino_tokenizers")),
    reason="needs gguf, openvino, openvino-genai and openvino-tokenizers",
)


def test_a_gguf_source_gets_the_candidates_that_keep_its_blocks():
    from optimize.compile.race.candidates import CANDIDATES, default_candidates

    carried = ["openvino_genai_gguf_kv_u8", "openvino_genai_gguf_dq32_kv_u8", "ort_genai_gguf_int8_grid", "native_gguf"]
    assert default_candidates(True, gguf=True)[:4] == carried
    assert not set(carried) & set(default_candidates(True))
    # The mixed INT4 row: GPTQ from a full-precision source, AWQ + scale estimation from a 4-bit file.
    assert "openvino_genai_int4_awq_gptq_r80_kv_u8" in default_candidates(True)
    assert "openvino_genai_int4_awq_r80_kv_u8" in default_candidates(True, gguf=True)
    assert len(default_candidates(True)) == len(default_candidates(True, gguf=True)) - len(carried)
    assert CANDIDATES["openvino_genai_gguf"].engine == "openvino_genai_gguf"
    # The default OpenVINO GenAI rows of a GGUF serve with the u8 KV cache, as the re-quantized ones do.
    assert all(CANDIDATES[n].engine_params["kv_cache_precision"] == "u8" for n in carried[:2])


@pytest.fixture(scope="module")
def q4_1(tmp_path_factory) -> Path:
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    root = tmp_path_factory.mktemp("q4_1")
    folder = tiny_llama_folder(root / "hf")
    return write_gguf(folder, root / "tiny.Q4_1.gguf", lambda name: "Q8_0" if "token_embd" in name else "Q4_1")


@pytest.mark.slow
def test_the_race_carries_a_q4_1_gguf_through_at_the_source_perplexity(q4_1, tmp_path):
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={q4_1}",
        *TINY_LM_RACE,
        "engine.params.candidates=[openvino_genai_gguf,openvino_genai_gguf_kv_u8,openvino_genai_int4_g32,native_gguf]",
        "gate.max_ppl_increase_over_source_pct=0.5",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    race = {c["name"]: c for c in manifest["stages"]["engine"]["candidates"]}
    carried = race["openvino_genai_gguf"]
    assert abs(carried["metrics"]["perplexity_increase_pct"]) < 0.05, carried["metrics"]
    assert carried["precision"] == "gguf:Q4_1+Q8_0"
    check = next(c for c in carried["accuracy_checks"] if c["name"] == "max_ppl_increase_over_source_pct")
    assert check["passed"], check
    # The u8 KV cache it serves with is the one it was scored with: close, not exact.
    quantized_cache = race["openvino_genai_gguf_kv_u8"]["metrics"]
    assert quantized_cache["perplexity"] != carried["metrics"]["perplexity"]
    assert abs(quantized_cache["perplexity_increase_pct"]) < 2.0, quantized_cache
    # The native kernels: the same perplexity where the CPU runs them, a named reason where it cannot.
    native = race["native_gguf"]
    if native_build.unavailable() is None:
        assert abs(native["metrics"]["perplexity_increase_pct"]) < 0.05, native
        # Served one sequence at a time: driven at one client, its sixteen-client cells derived from it;
        # the batching engines are driven at both levels.
        for name, candidate in race.items():
            for by_level in (candidate["metrics"] or {}).get("served", {}).values():
                assert "derived" not in by_level["1"]
                assert ("derived" in by_level["16"]) == (name == "native_gguf"), (name, by_level["16"])
                if name == "native_gguf":
                    assert by_level["16"]["request_ms"] == pytest.approx(16 * by_level["1"]["request_ms"], abs=1)
    else:
        assert native_build.unavailable() in native["outcome"], native
    reference = manifest["metrics"]["baseline"]["reference"]
    assert reference["kind"] == "gguf" and reference["gguf_types"] == {"Q4_1": 14, "Q8_0": 1}
    assert "baseline: the GGUF file tiny.Q4_1.gguf dequantized to FP32" in proc.stdout
    assert "baseline: the GGUF file" in (out / "report.md").read_text()
    if manifest["stages"]["engine"]["winner"] == "openvino_genai_gguf":
        record = manifest["stages"]["engine"]["winner_engine"]
        assert record["weights"] == "as in the source"
        assert record["gguf_types"]["Q4_1"]["count"] == 14 and record["made_exact"] == {"Q4_1": 14}


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, uncarried, says",
    [
        ("openvino_genai_gguf", "Q5_0", "does not read these tensors' types"),
        ("native_gguf", "F16", "matrices, not these tensors' types"),  # it carries Q5_0 and the K-quants
    ],
)
def test_a_gguf_the_reader_cannot_carry_is_one_line_exit_2(tmp_path, method, uncarried, says):
    """engine.method=openvino_genai_gguf (or native_gguf) alone on a file with matrices of a type it does not
    read: exit 2 naming them."""
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    folder = tiny_llama_folder(tmp_path / "hf")
    path = write_gguf(folder, tmp_path / "tiny.gguf", lambda name: uncarried if "ffn_up" in name else "Q8_0")
    proc = run_optimize(
        f"model.source={path}",
        *TINY_LM_RACE,
        f"engine={method}",
        f"output_dir={tmp_path / 'artifact'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = one_error_line(proc, says, f"blk.0.ffn_up.weight ({uncarried})", log_lines=True)
    assert f"blk.1.ffn_up.weight ({uncarried})" in line
    assert not (tmp_path / "artifact").exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("onnxruntime_genai") is None, reason="needs onnxruntime-genai")
def test_onnxruntime_genai_carries_a_q4_1_gguf_at_the_source_perplexity(q4_1, tmp_path):
    """engine=onnxruntime_genai_gguf through the command line: the file's blocks in the MatMulNBits
    weights, the source perplexity, the manifest naming what each type became (the Q8_0 embedding f32)."""
    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={q4_1}",
        *TINY_LM_RACE,
        "engine=onnxruntime_genai_gguf",
        "gate.max_ppl_increase_over_source_pct=0.5",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert abs(manifest["metrics"]["candidate"]["perplexity_increase_pct"]) < 0.01, manifest["metrics"]
    record = manifest["stages"]["engine"]
    assert record["weights"] == "as in the source" and record["carried"] == {"Q4_1": 14}
    assert record["gguf_types"]["Q8_0"]["became"].startswith("f32, dequantized from the file")
    assert record["gguf_types"]["Q4_1"]["became"].startswith("MatMulNBits bits 4")


@pytest.mark.slow
@pytest.mark.skipif(native_build.unavailable() is not None, reason=f"{native_build.unavailable()}")
def test_the_native_kernels_carry_a_q4_1_gguf_at_the_source_perplexity_and_serve_it(q4_1, tmp_path):
    """engine=native_gguf through the command line: the file itself in the artifact, the source
    perplexity, the manifest naming what each type became; then the artifact answers a chat request."""
    from tests.support.serve import in_process

    out = tmp_path / "artifact"
    proc = run_optimize(
        f"model.source={q4_1}",
        *TINY_LM_RACE,
        "engine=native_gguf",
        "gate.max_ppl_increase_over_source_pct=0.01",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / 'run'}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert abs(manifest["metrics"]["candidate"]["perplexity_increase_pct"]) < 0.01, manifest["metrics"]
    assert manifest["engine"]["format"] == "native-gguf" and manifest["engine"]["precision"] == "gguf:Q4_1+Q8_0"
    record = manifest["stages"]["engine"]
    assert record["weights"] == "as in the source" and record["gguf_file"] == "tiny.Q4_1.gguf"
    assert record["gguf_types"]["Q4_1"]["count"] == 14 and "(exact)" in record["gguf_types"]["Q4_1"]["became"]
    assert (out / "native_gguf" / "tiny.Q4_1.gguf").read_bytes() == q4_1.read_bytes()
    with in_process(out) as client:
        reply = client.post(
            "/v1/chat/completions",
            json={
                "model": "smollm2_int4_cpu",
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 8,
                "seed": 3,
            },
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] > 0 and isinstance(body["choices"][0]["message"]["content"], str)
        refused = client.post(
            "/v1/chat/completions",
            json={
                "model": "smollm2_int4_cpu",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
            },
        )
        assert refused.status_code == 400, refused.text
