"""The checked ONNX export kept in the verified cache: a second export of the same weights with the same
settings reuses the graph and its check, other weights or settings export again, and a cached graph
that does not match its sealed record is exported again, never used."""

from __future__ import annotations

import pytest

from optimize.compile.onnx import OnnxExportConfig, export_key, onnx_engine
from tests.support.context import torch_context
from tests.support.models import tiny_bert, torch_model

pytestmark = pytest.mark.slow  # each exports a model, in this process


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # the cache key's folder


def export(teacher, scratch, cfg=None):
    ctx = torch_context(teacher, scratch)
    return onnx_engine(torch_model(teacher), cfg or OnnxExportConfig(), ctx), ctx


def test_the_same_weights_are_exported_once_and_their_check_reused(tmp_path):
    import onnx

    teacher = tiny_bert(layers=2)
    first, _ = export(teacher, tmp_path / "a")
    second, _ = export(teacher, tmp_path / "b")
    assert "from_cache" not in first.record and second.record["from_cache"] is True
    assert second.record["export_check"] == first.record["export_check"]
    assert second.onnx_path.parent == tmp_path / "b" / "onnx"  # a copy of the run's own, not the cache's file
    assert onnx.load(str(second.onnx_path)).graph == onnx.load(str(first.onnx_path)).graph

    other_settings, _ = export(teacher, tmp_path / "c", OnnxExportConfig(ort_fusions=False))
    assert "from_cache" not in other_settings.record
    other_weights, _ = export(tiny_bert(layers=1), tmp_path / "d")
    assert "from_cache" not in other_weights.record


def test_a_cached_graph_that_fails_its_record_is_exported_again(tmp_path, caplog):
    teacher = tiny_bert(layers=2)
    first, ctx = export(teacher, tmp_path / "a")
    key = export_key(torch_model(teacher), OnnxExportConfig(), ctx)
    (cached,) = (tmp_path / "cache" / "export").glob(f"{key[:24]}/model.onnx")
    cached.write_bytes(cached.read_bytes() + b"\0")  # a graph swapped in the cache
    again, _ = export(teacher, tmp_path / "b")
    assert "from_cache" not in again.record and "its files differ" in caplog.text
    third, _ = export(teacher, tmp_path / "c")  # exported again and sealed: reused from here on
    assert third.record["from_cache"] is True
