"""The served-load driver (optimize/evaluate/served.py, used by benchmarks/serve_llm_load.py and a
served-latency gate) on the tiny OpenVINO GenAI artifact: every request answered and counted, the
figures present, clients that leave after their first token counted as answered."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.serve import running_server

NAME = "tiny_llm"
TEXTS = ["def main():", "The return statement", "A class definition", "import sys"] * 2


@pytest.fixture(scope="module")
def prompts(tiny_ov_llm_artifact) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_ov_llm_artifact / "ov" / "tokenizer.json"))
    return [tokenizer.encode(text).ids for text in TEXTS]


def test_drive_measures_every_request(tiny_ov_llm_artifact, prompts):
    from optimize.evaluate.served import drive, drive_async

    with running_server(tiny_ov_llm_artifact, "--max-tokens", "16") as server:
        figures = drive(server.url, NAME, prompts, clients=4, per_client=2, new_tokens=8, timeout_s=60)
        assert figures["requests"] == 8 and figures["failed"] == 0, figures
        assert 0 < figures["output_tokens"] <= 8 * 8
        assert figures["tokens_per_s"] > 0 and figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        results, _ = asyncio.run(drive_async(server.url, NAME, prompts, 4, 1, 8, 60, leave_share=0.5))
        assert [r.status for r in results] == [200] * 4 and not any(r.error for r in results)
        bad = drive(server.url, "no-such-model", prompts, clients=1, per_client=1, new_tokens=8, timeout_s=60)
        assert bad["failed"] == 1 and "does not exist" in bad["errors"][0]


def test_served_load_starts_and_stops_the_server(tiny_ov_llm_artifact, prompts):
    from optimize.evaluate.served import served_load

    figures = served_load(tiny_ov_llm_artifact, prompts, clients=2, requests_per_client=1, new_tokens=4)
    assert figures["requests"] == 2 and figures["failed"] == 0, figures


def test_a_structured_share_constrains_that_share_and_every_reply_validates(tiny_ov_llm_artifact, prompts):
    from optimize.evaluate.served import drive

    with running_server(tiny_ov_llm_artifact, "--max-tokens", "48") as server:
        figures = drive(server.url, NAME, prompts, 4, 2, 48, timeout_s=60, structured_share=0.5)
    assert figures["failed"] == 0, figures
    structured = figures["structured"]
    assert structured["requests"] == 4 and structured["answered"] == 4, structured
    assert structured["invalid"] == 0 and structured["valid"] + structured["cut"] == 4, structured
    assert structured["valid"] >= 1  # the compact grammar ends well within 48 tokens
