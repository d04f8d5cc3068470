"""Token-level fidelity (optimize/evaluate/token_fidelity.py): the KL divergence, top-1 agreement and Δp
arithmetic against a hand computation on a tiny model, the baseline's top-k reference against the full
computation on a real (tiny, random) Llama, and the race's screen on a prefix of the texts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from optimize.evaluate import token_fidelity as tf


class Bigram:
    """A tiny causal LM: the logits after a token are its row of a table (so each position depends
    only on the token before it, and a hand computation can follow every number)."""

    def __init__(self, table):
        self.table = np.asarray(table, dtype=np.float64)

    def logits(self, ids):
        return self.table[np.asarray(ids)]


BASE = [[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]]
CAND = [[1.0, 2.0, 0.0], [0.0, 0.5, 3.0], [1.0, 1.0, 1.0]]


def _softmax(row):
    exps = [math.exp(x) for x in row]
    return [e / sum(exps) for e in exps]


def test_kld_agreement_and_delta_p_match_a_hand_computation():
    ids = [0, 1, 2, 0]  # predictions: after 0 comes 1, after 1 comes 2, after 2 comes 0
    texts = {"prose": ids}
    ref = tf.reference(Bigram(BASE), texts, window=8, k=3)  # k = vocab: exact
    figures = tf.compare(ref, Bigram(CAND), texts, window=8)

    kls, agree, dps = [], [], []
    for prev, nxt in zip(ids, ids[1:]):
        p, q = _softmax(BASE[prev]), _softmax(CAND[prev])
        kls.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
        agree.append(p.index(max(p)) == q.index(max(q)))
        dps.append(q[nxt] - p[nxt])
    assert figures["tokens"] == 3
    assert figures["mean_kld"] == pytest.approx(sum(kls) / 3, rel=1e-6)
    assert figures["top1_agreement"] == pytest.approx(sum(agree) / 3)  # position 0 disagrees: 2/3
    assert figures["top1_agreement"] == pytest.approx(2 / 3)
    assert figures["rms_delta_p_pct"] == pytest.approx(100 * math.sqrt(sum(d * d for d in dps) / 3), rel=1e-6)
    assert figures["mean_delta_p_pct"] == pytest.approx(100 * sum(dps) / 3, rel=1e-6)
    assert figures["p99_kld"] <= max(kls) + 1e-12
    nll = [-math.log(_softmax(CAND[prev])[nxt]) for prev, nxt in zip(ids, ids[1:])]
    assert figures["candidate_perplexity"] == pytest.approx(math.exp(sum(nll) / 3), rel=1e-6)
    base_nll = [-math.log(_softmax(BASE[prev])[nxt]) for prev, nxt in zip(ids, ids[1:])]
    assert figures["baseline_perplexity"] == pytest.approx(math.exp(sum(base_nll) / 3), rel=1e-6)


def test_the_top1_reference_is_the_kl_over_the_top_token_and_the_rest_by_hand():
    """k=1 without draws from the rest: the baseline's most likely token and "any other" as two outcomes."""
    texts = {"prose": [0, 1]}
    ref = tf.reference(Bigram(BASE), texts, window=8, k=1, samples=0)
    figures = tf.compare(ref, Bigram(CAND), texts, window=8)
    p, q = _softmax(BASE[0]), _softmax(CAND[0])
    top = p.index(max(p))
    expected = p[top] * math.log(p[top] / q[top]) + (1 - p[top]) * math.log((1 - p[top]) / (1 - q[top]))
    assert figures["mean_kld"] == pytest.approx(expected, rel=1e-6)


class TorchLlama:
    def __init__(self, model):
        self.model = model

    def logits(self, ids):
        import torch

        with torch.inference_mode():
            return self.model(input_ids=torch.tensor([list(ids)]), use_cache=False).logits[0].double().numpy()


def _full_kl(base, cand, texts, window):
    """KL over the whole vocabulary, computed apart from the module (torch's kl_div)."""
    import torch

    values = []
    for ids in texts.values():
        for segment in tf.windows(ids, window):
            p = torch.log_softmax(torch.tensor(base.logits(segment)[:-1]), -1)
            q = torch.log_softmax(torch.tensor(cand.logits(segment)[:-1]), -1)
            values.append(torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1).numpy())
    return np.concatenate(values)


def test_top_k_reference_against_the_full_vocabulary_on_a_tiny_llama():
    import torch

    from tests.support.models import tiny_llama

    base = TorchLlama(tiny_llama(vocab_size=100, max_positions=64))
    noisy = tiny_llama(vocab_size=100, max_positions=64)
    with torch.no_grad():
        for weight in noisy.parameters():
            weight.add_(0.5 * torch.randn_like(weight) * weight.abs().mean())
    cand = TorchLlama(noisy)
    rng = np.random.default_rng(0)
    texts = {"prose": rng.integers(0, 100, 70).tolist(), "code": rng.integers(0, 100, 40).tolist()}
    full = _full_kl(base, cand, texts, window=32)

    exact = tf.compare(tf.reference(base, texts, 32, k=100), cand, texts, 32)
    # The reference keeps float32 log-probs: about 1e-7 nats a position apart from float64.
    assert exact["mean_kld"] == pytest.approx(full.mean(), rel=1e-4, abs=1e-6)
    assert (
        exact["tokens"] == len(full) == (70 - 3) + (40 - 2)
    )  # each window of 32 restarts: its first token is not scored
    assert set(exact["by_kind"]) == {"prose", "code"}
    coarse = tf.compare(tf.reference(base, texts, 32, k=8, samples=0), cand, texts, 32)
    assert 0 < coarse["mean_kld"] <= full.mean() + 1e-12  # merging outcomes never raises a divergence
    assert coarse["top1_agreement"] == exact["top1_agreement"]  # exact whatever k
    assert coarse["rms_delta_p_pct"] == pytest.approx(exact["rms_delta_p_pct"], rel=1e-5)
    # The tail's draws estimate what merging it loses: the figure comes back to the full one.
    drawn = tf.compare(tf.reference(base, texts, 32, k=8), cand, texts, 32)
    assert full.mean() - coarse["mean_kld"] > 0.1 * full.mean()
    assert drawn["mean_kld"] == pytest.approx(full.mean(), rel=0.05)
    assert drawn["top1_agreement"] == exact["top1_agreement"]


def test_the_tails_draws_estimate_the_divergence_inside_the_rest_without_bias():
    """k=1 over three tokens: the rest is two tokens, and many draws from it give the full KL."""
    ids = [0, 1, 2, 0]
    texts = {"prose": ids}
    ref = tf.reference(Bigram(BASE), texts, window=8, k=1, samples=20000)
    figures = tf.compare(ref, Bigram(CAND), texts, window=8)
    kls = []
    for prev in ids[:-1]:
        p, q = _softmax(BASE[prev]), _softmax(CAND[prev])
        kls.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
    assert figures["mean_kld"] == pytest.approx(sum(kls) / 3, rel=0.01)
    assert not (ref.tail_ids == ref.top_ids).any()  # k=1: each row drawn from outside its own top token
    again = tf.reference(Bigram(BASE), texts, window=8, k=1, samples=20000)
    assert np.array_equal(again.tail_ids, ref.tail_ids)  # seeded: the same draws every run


def test_the_screen_reference_is_the_reference_of_the_prefix():
    from tests.support.models import tiny_llama

    base = TorchLlama(tiny_llama(vocab_size=100, max_positions=64))
    rng = np.random.default_rng(1)
    texts = {"prose": rng.integers(0, 100, 90).tolist(), "code": rng.integers(0, 100, 90).tolist()}
    prefixes = {kind: ids[:40] for kind, ids in texts.items()}
    full = tf.reference(base, texts, 32, k=5)
    direct = tf.reference(base, prefixes, 32, k=5)
    cut = full.prefix_of(texts, prefixes, 32)
    assert np.array_equal(cut.targets, direct.targets)
    assert np.array_equal(cut.top_ids, direct.top_ids)
    np.testing.assert_allclose(cut.top_logp, direct.top_logp, atol=1e-5)


def test_a_candidate_on_other_tokens_is_refused():
    ref = tf.reference(Bigram(BASE), {"prose": [0, 1, 2]}, window=8, k=3)
    with pytest.raises(ValueError, match="other tokens"):
        tf.compare(ref, Bigram(CAND), {"prose": [0, 2, 2]}, window=8)


def test_a_reference_round_trips_through_its_file(tmp_path):
    ref = tf.reference(Bigram(BASE), {"prose": [0, 1, 2, 0]}, window=8, k=2)
    ref.save(tmp_path / "reference.npz")
    back = tf.Reference.load(tmp_path / "reference.npz")
    assert np.array_equal(back.top_ids, ref.top_ids) and list(back.kinds) == ["prose"] * 3


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def test_the_race_keeps_the_baseline_reference_sealed_and_refuses_an_edited_one(isolated_cache):
    from optimize.compile.race import lm
    from optimize.tasks.causal_lm import LLMEvalConfig

    cfg = LLMEvalConfig(fidelity_window=8, fidelity_top_k=2)
    texts = {"prose": [0, 1, 2, 0, 1]}
    ref = tf.reference(Bigram(BASE), texts, 8, k=2)
    identity = tf.reference_identity(texts, 8, 2)
    lm._save_reference("key", identity, ref)
    loaded, got = lm._load_reference("key", texts, cfg)
    assert got == identity and np.array_equal(loaded.top_logp, ref.top_logp)
    # An edited reference would move every candidate's KLD: it is computed again, not used.
    folder = lm._reference_folder("key", identity)
    edited = tf.Reference(**{k: getattr(ref, k) for k in tf.FIELDS})
    edited.top_logp = edited.top_logp * 0
    edited.save(folder / "reference.npz")
    assert lm._load_reference("key", texts, cfg) is None
    assert lm._load_reference("key", {"prose": [0, 1, 2]}, cfg) is None  # other tokens: not this entry


def test_the_screen_takes_an_equal_share_of_each_kind_and_stops_a_clear_loser():
    from types import SimpleNamespace

    from optimize.compile.race.lm import _screened_out
    from optimize.tasks.lm_fidelity import screen_texts

    assert screen_texts({"prose": list(range(100)), "code": list(range(50))}, 40) == {
        "prose": list(range(20)),
        "code": list(range(20)),
    }
    worse = SimpleNamespace(metrics={"fidelity": {"mean_kld": 0.4, "top1_agreement": 0.7}})
    close = SimpleNamespace(metrics={"fidelity": {"mean_kld": 0.01, "top1_agreement": 0.95}})
    thresholds = {"max_mean_kld": 0.1, "min_top1_agreement": 0.8}
    assert _screened_out(worse, thresholds) and not _screened_out(close, thresholds)
    assert _screened_out(SimpleNamespace(metrics={"fidelity": {"mean_kld": 0.01, "top1_agreement": 0.7}}), thresholds)
    assert not _screened_out(worse, {})  # nothing to screen on
