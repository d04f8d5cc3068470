"""The race's build cache is untrusted input: a cached candidate is used only when its files match the
signed record written when it was built, by this code, from this key; anything else is rebuilt with
the reason, and runs sharing one cache never collide."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from optimize import cache_store
from optimize.compile.race import cache
from optimize.compile.race.candidates import Candidate
from optimize.context import Model

SPEC = Candidate(engine="onnxruntime", engine_params={"precision": "fp32"})


def _onnx(path: Path, bias: float) -> Path:
    """A one-node ONNX graph (y = x + bias): small, real, and different for each bias."""
    import onnx
    from onnx import TensorProto, helper

    b = helper.make_tensor("b", TensorProto.FLOAT, [1], [bias])
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [b],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), str(path))
    return path


def _built(tmp_path: Path, bias: float = 1.0) -> Model:
    return Model("onnx", "feature-extraction").with_onnx(_onnx(tmp_path / f"built{bias}" / "model.onnx", bias))


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(cache_store.KEY_ENV, raising=False)
    return tmp_path / "cache"


def _save(tmp_path: Path, key_base: str = "base", bias: float = 1.0) -> Path:
    cache.save(
        _built(tmp_path, bias),
        {"engine": {"precision": "fp32"}},
        cache.folder(key_base, SPEC),
        cache.key_of(key_base, SPEC),
    )
    return cache.folder(key_base, SPEC)


def test_a_candidate_saved_to_the_cache_is_used_again(isolated_cache, tmp_path):
    where = _save(tmp_path)
    model, records, why = cache.load_cached("base", SPEC, _built(tmp_path))
    assert why == "" and model.onnx_path == where / "model.onnx" and records == {"engine": {"precision": "fp32"}}
    assert [p.name for p in where.parent.iterdir()] == [where.name]  # no staging folder left behind


def test_a_swapped_model_onnx_is_rebuilt_not_shipped(isolated_cache, tmp_path):
    where = _save(tmp_path)
    (where / "model.onnx").write_bytes(_onnx(tmp_path / "other" / "model.onnx", 5.0).read_bytes())
    model, _, why = cache.load_cached("base", SPEC, _built(tmp_path))
    assert model is None and "files differ" in why and "model.onnx" in why
    assert not where.exists()  # removed, to be rebuilt


@pytest.mark.parametrize("content", ["{not json", json.dumps({"kind": "onnx", "precision": "int8"})])
def test_an_edited_or_corrupt_candidate_json_is_rebuilt(isolated_cache, tmp_path, content):
    where = _save(tmp_path)
    (where / "candidate.json").write_text(content)
    model, _, why = cache.load_cached("base", SPEC, _built(tmp_path))
    assert model is None and "candidate.json" in why


def test_a_record_rewritten_to_match_changed_files_fails_its_signature(isolated_cache, tmp_path):
    where = _save(tmp_path)
    (where / "model.onnx").write_bytes(_onnx(tmp_path / "other" / "model.onnx", 5.0).read_bytes())
    record = json.loads((where / cache_store.RECORD).read_text())
    record["body"]["files"] = cache_store._files(where)  # what a forger can compute without the key
    (where / cache_store.RECORD).write_text(json.dumps(record))
    model, _, why = cache.load_cached("base", SPEC, _built(tmp_path))
    assert model is None and "not signed with this machine's cache key" in why


def test_a_folder_built_by_other_code_or_from_another_source_is_rebuilt(isolated_cache, tmp_path):
    import hashlib
    import hmac

    where = _save(tmp_path)
    key = cache_store.cache_key()
    assert key is not None
    record = json.loads((where / cache_store.RECORD).read_text())
    record["body"]["code"] = "0" * 64
    body = json.dumps(record["body"], sort_keys=True).encode()
    record["signature"] = hmac.new(key, body, hashlib.sha256).hexdigest()
    (where / cache_store.RECORD).write_text(json.dumps(record))
    assert (
        cache.load_cached("base", SPEC, _built(tmp_path))[2]
        == "it was built by another version of this code or its packages"
    )

    where = _save(tmp_path)
    assert cache_store.open_verified(where, "another key")[1] == "it was built from another source"


def test_the_report_says_when_a_cached_copy_was_rejected():
    from optimize.compile.race import cells
    from optimize.compile.race.entry import Entry

    entry = Entry(
        "ort_fp32", SPEC, model=SimpleNamespace(precision="fp32"), build_s=3.0, cache_rebuilt="its files differ"
    )
    assert cells.build_words(entry) == "3 (cached copy failed its check)"
    assert entry.report()["cache_rebuilt"] == "its files differ"
    entry.cache_rebuilt = "it was built by another version of this code or its packages"
    assert cells.build_words(entry) == "3 (cached copy from another version)"


def test_a_cache_folder_from_before_records_or_with_a_link_is_rebuilt(isolated_cache, tmp_path):
    where = _save(tmp_path)
    (where / cache_store.RECORD).unlink()
    assert cache.load_cached("base", SPEC, _built(tmp_path))[2] == "it has no cache record"

    where = _save(tmp_path)
    (where / "extra.onnx").symlink_to(tmp_path / "built1.0" / "model.onnx")
    assert "not a regular file" in cache.load_cached("base", SPEC, _built(tmp_path))[2]


# Two processes building and reading the same cached candidate at once, many rounds: each round's
# build goes through its own staging folder, so neither ever reads a half-written or foreign one.
RACER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tests.optimize.test_race_cache import SPEC, _built
    from optimize.compile.race import cache
    from optimize import cache_store

    work = Path(sys.argv[1])
    for round in range(int(sys.argv[2])):
        model = cache.save(_built(work), {}, cache.folder("base", SPEC), cache.key_of("base", SPEC))
        assert model.onnx_path.read_bytes(), "empty model"
        got, _, why = cache.load_cached("base", SPEC, _built(work))
        assert got is not None and got.onnx_path.read_bytes(), why  # both runs' copies verify: same code, key
    """
)


@pytest.mark.slow
def test_two_runs_building_the_same_cached_candidate_at_once_never_collide(isolated_cache, tmp_path):
    import os

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path / f"w{i}"), "20"], env=env, stderr=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
    where = _save(tmp_path)
    assert cache_store.open_verified(where, cache.key_of("base", SPEC)) == (True, "")
    assert [p.name for p in where.parent.iterdir()] == [where.name]


def _race(tmp_path: Path, name: str, candidates: str) -> tuple[subprocess.CompletedProcess, Path]:
    from tests.support.cli import run_optimize

    out = tmp_path / name
    proc = run_optimize(
        f"engine.params.candidates=[{candidates}]",
        "evaluate.data.count=16",
        "calibration.count=16",
        "evaluate.batch_sizes=[1]",
        "evaluate.repeats=4",
        "evaluate.warmup=1",
        "evaluate.retimes=0",  # no speed gated; the other test worker shares the machine
        "evaluate.memory=false",
        "engine.params.timing_repeats=4",
        "gate.min_speedup=null",
        "gate.min_topk_agreement=null",
        "gate.min_cosine=0.5",
        "gate.min_mean_cosine=0.5",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path / (name + '-run')}",
        env={"OPTIMIZE_CACHE": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def test_an_int8_model_swapped_into_the_cached_fp32_candidate_is_rebuilt_not_shipped(minilm_default_race, tmp_path):
    """The attack of issue 35: after a race, the INT8 candidate's model.onnx copied over the cached FP32
    candidate's; a rerun racing only ort_fp32 shipped MatMulInteger nodes under `onnxruntime fp32`. The
    race is the default recipe's (the session's): a copy of its cache and of the key that signed it."""
    import onnx

    from engines.artifact import read_manifest

    shutil.copytree(minilm_default_race.cache, tmp_path / "cache")
    shutil.copytree(minilm_default_race.config, tmp_path / "config")
    onnxruntime = {}  # precision -> the folder of an ONNX Runtime candidate (the INT8 ones: any of them)
    for record in sorted((tmp_path / "cache" / "race").glob("*/candidate.json")):
        saved = json.loads(record.read_text())
        if saved["engine"]["format"] == "onnxruntime":
            onnxruntime.setdefault(saved["precision"], record.parent)
    (onnxruntime["fp32"] / "model.onnx").write_bytes((onnxruntime["int8"] / "model.onnx").read_bytes())

    proc, out = _race(tmp_path, "second", "ort_fp32")
    assert "cached copy failed its check" in proc.stdout  # the report's build column
    (candidate,) = read_manifest(out)["stages"]["engine"]["candidates"]
    assert not candidate["cached"] and "files differ" in candidate["cache_rebuilt"] and candidate["precision"] == "fp32"
    ops = {n.op_type for f in out.rglob("*.onnx") for n in onnx.load(str(f), load_external_data=False).graph.node}
    assert ops and "MatMulInteger" not in ops and "DynamicQuantizeLinear" not in ops


def test_edited_baseline_figures_are_measured_again_not_used(isolated_cache):
    key = cache.baseline_key("model-and-machine", {"shapes": ["64x64"]})
    cache.save_baseline(key, {"perplexity": 18.2})
    assert cache.load_baseline(key) == {"perplexity": 18.2}
    (figures,) = isolated_cache.glob(f"race/baseline-{key}/figures.json")
    figures.write_text(json.dumps({"perplexity": 99.0}))  # a slower, worse baseline flatters every candidate
    assert cache.load_baseline(key) is None
    assert not figures.parent.exists()  # removed, to be measured and sealed again
