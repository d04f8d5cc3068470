"""benchmarks/serve_bench.py's own machinery on a real server, in seconds: the asyncio load
generator counts answers and reports failures, and the latency round measures every variant."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from tests.support.serve import ROOT, running_server


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "benchmarks" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(encoder_artifact):
    with running_server(encoder_artifact, "--max-batch-size", "4") as server:
        yield server


def test_load_generator_counts_answers(bench, server, encoder_name):
    body = json.dumps({"model": encoder_name, "input": bench.TEXT}).encode()
    result = asyncio.run(bench.load_generator(server.port, body, clients=4, seconds=1.0, warmup_s=0.3))
    assert result["errors"] == 0 and result["req_per_s"] > 0


def test_load_generator_reports_failed_requests(bench, server):
    body = json.dumps({"model": "no-such-model", "input": "x"}).encode()
    result = asyncio.run(bench.load_generator(server.port, body, clients=2, seconds=0.3, warmup_s=0.1))
    assert result["errors"] > 0 and result["first_error"].startswith("404")


def test_load_generator_in_its_own_process(bench, server, encoder_name):
    body = json.dumps({"model": encoder_name, "input": "hello"}).encode()
    assert bench.throughput(server.port, body, clients=2, seconds=0.5, warmup_s=0.2) > 0


def test_overhead_round_measures_served_and_both_direct_calls(bench, server, encoder_artifact, encoder_name):
    body = json.dumps({"model": encoder_name, "input": bench.TEXT}).encode()
    models = bench.direct_models(encoder_artifact, threads=1)
    p50 = bench.overhead_round(server.port, body, models, bench.TEXT, requests=4, block=2)
    assert set(p50) == {"served", "spinning", "sleeping", "direct"}
    assert all(value > 0 for value in p50.values())
    assert p50["direct"] == min(p50["spinning"], p50["sleeping"])
