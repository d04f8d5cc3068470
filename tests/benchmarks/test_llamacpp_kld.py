"""This project's KL divergence beside llama.cpp's (benchmarks/llamacpp_kld.py): its refusals in one
line (no llama-perplexity given, one that is not an executable, a text shorter than a chunk), and the
parsing of llama-perplexity's KLD summary."""

from __future__ import annotations

import pytest

from benchmarks import llamacpp_kld


def _refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as caught:
        llamacpp_kld.main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


def test_no_llama_perplexity_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv(llamacpp_kld.ENV, raising=False)
    assert "--llama-perplexity" in _refusal(capsys, [])


def test_a_path_that_is_not_an_executable_is_one_line(capsys, tmp_path, monkeypatch):
    plain = tmp_path / "llama-perplexity"
    plain.write_text("not a program")
    monkeypatch.setenv(llamacpp_kld.ENV, str(plain))
    assert "not an executable" in _refusal(capsys, [])
    assert "not an executable" in _refusal(capsys, ["--llama-perplexity", str(tmp_path / "missing")])


def test_fewer_tokens_than_a_chunk_is_one_line(capsys, tmp_path):
    tool = tmp_path / "llama-perplexity"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    assert "--tokens" in _refusal(capsys, ["--llama-perplexity", str(tool), "--tokens", "100", "--ctx", "512"])


def test_the_kld_summary_is_read_from_llama_perplexitys_output():
    log = (
        "kl_divergence: computing over 8 chunks, n_ctx=512, batch_size=512, n_seq=1\n"
        "====== KL divergence statistics ======\n"
        "Mean    KLD:   0.031234 ±   0.000512\n"
        "Maximum KLD:   2.345678\n"
        "====== Token probability statistics ======\n"
        "RMS Δp    :  4.123 ± 0.051 %\n"
        "Same top p: 91.912 ± 0.170 %\n"
    )
    assert llamacpp_kld._parse(log) == {
        "mean_kld": 0.031234,
        "rms_delta_p_pct": 4.123,
        "top1_agreement_pct": 91.912,
        "chunks": 8,
    }


def test_output_without_a_kld_is_refused(capsys):
    with pytest.raises(SystemExit):
        llamacpp_kld._parse("perplexity: 12.3\n")
    assert "no Mean KLD" in capsys.readouterr().err


def test_activations_round_to_q8_0_blocks_as_llama_cpp_rounds_them():
    import torch

    block = torch.tensor([127.0, 63.4, -0.6, 2.5] + [0.0] * 28)  # absmax 127: the scale is 1
    assert llamacpp_kld.q8_0_round(block).tolist()[:4] == [127.0, 63.0, -1.0, 3.0]
    x = torch.randn(4, 64)
    scale = x.reshape(-1, 32).abs().amax(-1, keepdim=True) / 127
    error = (llamacpp_kld.q8_0_round(x) - x).reshape(-1, 32).abs()
    assert bool((error <= scale * 0.5 * 1.01).all())  # half a step of each block's own scale
