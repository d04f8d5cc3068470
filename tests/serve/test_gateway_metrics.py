"""What an inference gateway's endpoint picker reads from /metrics (serve.metrics.GATEWAY_METRICS):
every name it is pointed at exists with the type it parses, the KV-cache usage is a fraction, the
cache info carries the labels it reads, and docs/deploy.md gives the same flags and names."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from serve.metrics import GATEWAY_METRICS, Metrics
from tests.support.serve import ROOT


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_every_metric_the_picker_reads_is_exported_with_its_type(encoder):
    exported = families(encoder.get("/metrics").text)
    for flag, (name, kind) in GATEWAY_METRICS.items():
        assert name in exported, f"{flag}: {name} is not in /metrics"
        assert exported[name].type == kind, f"{flag}: {name} is a {exported[name].type}, the picker reads a {kind}"
    # Before any generation: nothing queued or running, no KV block in use (a fraction, not a percent).
    for name in ("serve_num_requests_waiting", "serve_num_requests_running", "serve_kv_cache_usage_perc"):
        (sample,) = exported[name].samples
        assert sample.value == 0


def test_cache_info_carries_the_labels_the_prefix_scorer_reads():
    metrics = Metrics()
    metrics.set_cache_info(32, 1024)
    metrics.kv_cache_usage.set(0.25)
    exported = families(metrics.render()[0].decode())
    (sample,) = exported["serve_cache_config_info"].samples
    assert sample.labels == {"block_size": "32", "num_gpu_blocks": "1024"} and sample.value == 1
    assert 0 <= exported["serve_kv_cache_usage_perc"].samples[0].value <= 1


def test_deploy_doc_gives_each_flag_its_metric():
    doc = (ROOT / "docs" / "deploy.md").read_text()
    for flag, (name, _) in GATEWAY_METRICS.items():
        assert f"--{flag}={name}" in doc, f"docs/deploy.md does not give --{flag}={name}"


def test_a_batching_llm_exports_its_cache_layout(llm):
    """On a causal LM served with batching, the cache info is set from the engine's own layout."""
    exported = families(llm.get("/metrics").text)
    (sample,) = exported["serve_cache_config_info"].samples
    assert int(sample.labels["block_size"]) >= 1 and int(sample.labels["num_gpu_blocks"]) >= 1
    body = {"model": llm.get("/v1/models").json()["data"][0]["id"], "prompt": "Hello", "max_tokens": 4}
    assert llm.post("/v1/completions", json=body).status_code == 200
    usage = families(llm.get("/metrics").text)["serve_kv_cache_usage_perc"].samples[0].value
    assert 0 <= usage <= 1  # a fraction, as the picker reads it
