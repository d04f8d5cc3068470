"""Token-level fidelity of a causal LM against its baseline, paired on the same tokens: what
llama.cpp's `llama-perplexity --kl-divergence` reports.

At every scored position both sides' next-token distributions are the log-softmax of their logits
over the whole vocabulary. Per position:
- KL(baseline || candidate), in nats;
- whether the candidate's argmax is the baseline's (top-1 agreement, llama.cpp's "same top p");
- the change in the probability of the token that really came next (Δp; its RMS over the positions
  is llama.cpp's "RMS Δp").

The baseline's distributions are kept once (`Reference`), not in full (16k positions x a 49k vocabulary
is 3 GB in f32): its top-k log-probabilities (k=128 by default) with their token ids, the mass outside
them ("the rest"), 64 tokens drawn at random from the rest (TAIL_SAMPLES, seeded) with their
log-probs, and the log-prob of the token that came next: 16,384 positions take 17 MB + 8 MB.

The KL divergence is then the sum of three parts. Over the baseline's top k, exact. The rest as one
outcome (the baseline's remaining mass against the candidate's mass on those same tokens): merging
outcomes never raises a divergence, so these two alone are a lower bound, and on SmolLM2 they kept only
84% of the whole-vocabulary figure at Q8_0 (k=32 72%): quantization moves probability across the whole
vocabulary. The third part is what merging lost, rest * KL(p' || q') with p' and q' each side's rest
renormalized, estimated from the draws: for a token i drawn from p', r = q'(i) / p'(i) has E[r] = 1,
so KL(p' || q') = E[r - 1 - log r], a mean of non-negative terms, unbiased. Each position's figure is
noisy (64 draws), the mean over thousands of positions is not: on SmolLM2 against llama.cpp's
whole-vocabulary `--kl-divergence` (benchmarks/llamacpp_kld.py, docs/figures-history.md) the default
reference gave 1.02x its mean KLD at Q8_0 and 1.00x at Q4_0 (the top 128 and the rest alone: 89%), and
against this project's own whole-vocabulary figure 99.9-100.1% over three seeds (p99 within 0.5%).
tests/optimize/test_token_fidelity.py holds the three parts to a hand
computation, to torch's full-vocabulary KL when k is the vocabulary, and within 5% of it with k=8 on a
random Llama (the first two parts alone 10% or more below). Top-1 agreement and Δp are exact.

Positions are scored in windows of `window` tokens, each starting without context (as perplexity is):
a window of n tokens scores its n-1 next-token predictions. `score_from` scores only the positions from
that index of each window on (llama.cpp scores the second half of each chunk).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)
TOP_K = 128
# Tokens drawn from the baseline's distribution outside its top k, per position: the tail's divergence
# is estimated from them (position_divergences).
TAIL_SAMPLES = 64
SEED = 0
FIELDS = ("top_ids", "top_logp", "rest", "tail_ids", "tail_logp", "target_logp", "targets", "kinds")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (the differences KL needs are small)."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def windows(ids: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive windows of the token stream, the last one shorter; windows of one token score nothing."""
    return [list(ids[i : i + window]) for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]


@dataclass
class Reference:
    """The baseline's part of every scored position: its top-k token ids and log-probs (descending),
    and the log-prob of the token that came next; `kinds` names the text each position is from."""

    top_ids: np.ndarray  # [n, k] int32
    top_logp: np.ndarray  # [n, k] float32
    rest: np.ndarray  # [n] float64: the baseline's probability mass outside its top k
    tail_ids: np.ndarray  # [n, s] int32: tokens drawn from the baseline's distribution outside its top k
    tail_logp: np.ndarray  # [n, s] float32: their log-probs
    target_logp: np.ndarray  # [n] float32
    targets: np.ndarray  # [n] int32, the token that came next
    kinds: np.ndarray  # [n] str

    def save(self, path) -> None:
        np.savez(path, **{k: getattr(self, k) for k in FIELDS})

    @classmethod
    def load(cls, path) -> Reference:
        with np.load(path, allow_pickle=False) as saved:
            return cls(**{k: saved[k] for k in FIELDS})

    def prefix_of(self, texts: dict[str, list[int]], prefixes: dict[str, list[int]], window: int) -> Reference:
        """The reference over `prefixes` (a prefix of each kind's ids in `texts`, which this reference was
        computed on): with causal attention a window's first positions do not depend on what follows
        them, so they are the first positions of each kind's block here."""
        keep = np.zeros(len(self), dtype=bool)
        at = 0
        for kind, ids in texts.items():
            block = sum(len(w) - 1 for w in windows(ids, window))
            if kind in prefixes:
                keep[at : at + sum(len(w) - 1 for w in windows(prefixes[kind], window))] = True
            at += block
        return Reference(*(getattr(self, k)[keep] for k in FIELDS))

    def __len__(self) -> int:
        return len(self.targets)


def _segments(texts: dict[str, list[int]], window: int) -> list[tuple[str, list[int]]]:
    return [(kind, segment) for kind, ids in texts.items() for segment in windows(ids, window)]


# Positions turned into float64 log-probs at once: a window of 512 over a 152k vocabulary is 620 MB
# in float64, 64 of its rows 78 MB; every figure is computed row by row, so the result is the same.
ROWS = 64


def _scored(logits: np.ndarray, segment: list[int], score_from: int):
    """(log-probs [positions, vocab], next tokens) of one window's scored positions, ROWS positions
    at a time."""
    scored = np.asarray(logits)[:-1][score_from:]
    targets = np.asarray(segment[1:], dtype=np.int64)[score_from:]
    for start in range(0, len(targets), ROWS):
        yield log_softmax(scored[start : start + ROWS]), targets[start : start + ROWS]


def reference(
    runner, texts: dict[str, list[int]], window: int, k: int = TOP_K, score_from: int = 0, samples: int = TAIL_SAMPLES
) -> Reference:
    """The baseline's `Reference` over the token streams `texts` ({kind: ids})."""
    parts: dict[str, list] = {key: [] for key in FIELDS}
    at = 0
    for kind, segment in _segments(texts, window):
        for logp, targets in _scored(runner.logits(segment), segment, score_from):
            top = _top_ids(logp, k)
            top_logp = np.take_along_axis(logp, top, axis=-1)
            order = np.argsort(-top_logp, axis=-1, kind="stable")
            parts["top_ids"].append(np.take_along_axis(top, order, axis=-1).astype(np.int32))
            parts["top_logp"].append(np.take_along_axis(top_logp, order, axis=-1).astype(np.float32))
            tail, rest = _tail_draws(logp, top, samples, first=at)
            parts["rest"].append(rest)
            parts["tail_ids"].append(tail.astype(np.int32))
            parts["tail_logp"].append(np.take_along_axis(logp, tail, axis=-1).astype(np.float32))
            parts["target_logp"].append(logp[np.arange(len(targets)), targets].astype(np.float32))
            at += len(targets)
            parts["targets"].append(targets.astype(np.int32))
            parts["kinds"].append(np.array([kind] * len(targets)))
    return Reference(**{key: np.concatenate(value) for key, value in parts.items()})


def _top_ids(logp: np.ndarray, k: int) -> np.ndarray:
    """The ids of each row's k largest values, in no order: torch's top-k, 3.5x quicker than numpy's
    argpartition on a 49k-token vocabulary (the partition was half the reference's own cost beside
    the model's forward passes)."""
    import torch

    return torch.topk(torch.from_numpy(np.ascontiguousarray(logp)), k, dim=-1, sorted=False).indices.numpy()


def _outside(logp: np.ndarray, top: np.ndarray) -> np.ndarray:
    """The probabilities of each row with its top ids' set to 0 (float64)."""
    p = np.exp(np.asarray(logp, dtype=np.float64))
    np.put_along_axis(p, np.asarray(top, dtype=np.int64), 0.0, axis=-1)
    return p


def _tail_draws(logp: np.ndarray, top: np.ndarray, samples: int, first: int) -> tuple[np.ndarray, np.ndarray]:
    """(`samples` token ids per row drawn with replacement from the distribution outside `top`, the mass
    outside `top`); summed, not 1 - the top's sum, which loses a small tail to rounding. Each row's draws
    are seeded by its position (`first` is the first row's), so they do not depend on how rows are
    grouped and are the same on every run."""
    p = _outside(logp, top)
    cdf = np.cumsum(p, axis=-1)
    rest = cdf[:, -1].copy()
    uniform = [np.random.default_rng((SEED, first + row)).random(samples) for row in range(len(p))]
    draws = np.array(uniform).reshape(len(p), samples) * rest[:, None]
    ids = np.stack([np.searchsorted(row, u, side="right") for row, u in zip(cdf, draws)])
    return np.minimum(ids, p.shape[-1] - 1), np.clip(rest, 0.0, 1.0)


def position_divergences(ref_top_ids, ref_top_logp, ref_rest, cand_logp: np.ndarray, tail=None) -> np.ndarray:
    """KL(baseline || candidate) per position: exact over the baseline's top k, plus the divergence of
    the rest as one outcome (a lower bound of the rest's share), plus, given `tail` (the reference's
    tail_ids and tail_logp), an estimate of the divergence inside the rest (`_inside_rest`)."""
    top_ids = np.asarray(ref_top_ids, dtype=np.int64)
    p_top_log = np.asarray(ref_top_logp, dtype=np.float64)
    q_top_log = np.take_along_axis(cand_logp, top_ids, axis=-1)
    kl = (np.exp(p_top_log) * (p_top_log - q_top_log)).sum(axis=-1)
    p_rest = np.asarray(ref_rest, dtype=np.float64)
    q_rest = np.clip(_outside(cand_logp, top_ids).sum(axis=-1), 1e-300, 1.0)
    has_rest = p_rest > 1e-12
    log_ratio = np.log(np.where(has_rest, p_rest, 1.0)) - np.log(q_rest)
    kl = kl + np.where(has_rest, p_rest * log_ratio, 0.0)
    if tail is not None:
        kl = kl + _inside_rest(p_rest, q_rest, has_rest, tail, cand_logp)
    return np.maximum(kl, 0.0)


def _inside_rest(p_rest, q_rest, has_rest, tail, cand_logp) -> np.ndarray:
    """The divergence between the two distributions within the rest, rest * KL(p' || q') (p' and q':
    each side's rest renormalized), from tokens i drawn from p': with r = q'(i) / p'(i), E[r] = 1, so
    KL(p' || q') = E[r - 1 - log r], a mean of non-negative terms. Unbiased: the mean over positions
    converges on the whole-vocabulary figure as positions are added."""
    ids, p_log = (np.asarray(a) for a in tail)
    if ids.shape[-1] == 0:
        return np.zeros_like(p_rest)
    q_log = np.take_along_axis(cand_logp, ids.astype(np.int64), axis=-1) - np.log(q_rest)[:, None]
    p_log = p_log.astype(np.float64) - np.log(np.where(has_rest, p_rest, 1.0))[:, None]
    log_r = q_log - p_log
    inside = (np.expm1(log_r) - log_r).mean(axis=-1)
    return np.where(has_rest, p_rest * inside, 0.0)


def compare(ref: Reference, runner, texts: dict[str, list[int]], window: int, score_from: int = 0) -> dict:
    """The candidate's fidelity to `ref` on the same token streams: per position KL, top-1 agreement
    and Δp, summarized (`summary`) over all positions and per kind of text."""
    kl, agree, dp, nll = [], [], [], []
    at = 0
    for _kind, segment in _segments(texts, window):
        for logp, targets in _scored(runner.logits(segment), segment, score_from):
            rows = slice(at, at + len(targets))
            if not np.array_equal(targets, ref.targets[rows]):
                raise ValueError("the candidate was scored on other tokens than the reference")
            tail = (ref.tail_ids[rows], ref.tail_logp[rows])
            kl.append(position_divergences(ref.top_ids[rows], ref.top_logp[rows], ref.rest[rows], logp, tail))
            agree.append(logp.argmax(axis=-1) == ref.top_ids[rows, 0])
            correct = logp[np.arange(len(targets)), targets]
            dp.append(np.exp(correct) - np.exp(ref.target_logp[rows].astype(np.float64)))
            nll.append(-correct)
            at += len(targets)
    if at != len(ref):
        raise ValueError(f"the reference holds {len(ref)} positions, the texts give {at}")
    figures = summary(np.concatenate(kl), np.concatenate(agree), np.concatenate(dp), ref.kinds)
    # Both sides' perplexity on the same positions (the baseline's from its kept log-probs).
    figures["baseline_perplexity"] = float(np.exp(-ref.target_logp.astype(np.float64).mean()))
    figures["candidate_perplexity"] = float(np.exp(np.concatenate(nll).mean()))
    return figures


def summary(kl: np.ndarray, agree: np.ndarray, dp: np.ndarray, kinds: Optional[np.ndarray] = None) -> dict:
    """Mean and 99th-percentile KL (nats), top-1 agreement (share), RMS and mean Δp (percentage points)."""
    out = _figures(kl, agree, dp)
    if kinds is not None and len(set(kinds.tolist())) > 1:
        out["by_kind"] = {
            str(k): _figures(kl[kinds == k], agree[kinds == k], dp[kinds == k]) for k in sorted(set(kinds.tolist()))
        }
    return out


def _figures(kl: np.ndarray, agree: np.ndarray, dp: np.ndarray) -> dict:
    return {
        "mean_kld": float(kl.mean()),
        "p99_kld": float(np.percentile(kl, 99)),
        "top1_agreement": float(agree.mean()),
        "rms_delta_p_pct": float(np.sqrt(np.mean(dp**2)) * 100),
        "mean_delta_p_pct": float(dp.mean() * 100),
        "tokens": int(len(kl)),
    }


def reference_identity(texts: dict[str, list[int]], window: int, k: int) -> str:
    """The cache identity of a baseline's reference: what is scored, its top k and its tail's draws."""
    return texts_sha256(texts, window) + f"-k{k}-s{TAIL_SAMPLES}"


def texts_sha256(texts: dict[str, list[int]], window: int, score_from: int = 0) -> str:
    """The identity of what is scored: the token ids of each kind, the window and the first scored index."""
    what = {"texts": texts, "window": window, "score_from": score_from}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
