"""Token-level fidelity and standard tasks for a causal-LM candidate against its baseline: the texts
scored, the baseline's part computed once per run (or read from the race's cache), and the figures the
gate reads (optimize/evaluate/token_fidelity.py has the arithmetic, calibration/fidelity_texts.py the
texts, calibration/standard_tasks.py the tasks' data)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Optional

from optimize.errors import RecipeError
from optimize.stages import EVALUATION, stage

log = logging.getLogger(__name__)


def fidelity_texts(tokens, cfg) -> dict[str, list[int]]:
    """{kind: token ids}: an equal share of evaluate.task_params.fidelity_tokens from each kind of text."""
    from calibration.fidelity_texts import text_of

    share = cfg.fidelity_tokens // len(cfg.fidelity_kinds)
    texts = {}
    for kind in cfg.fidelity_kinds:
        ids = tokens(text_of(kind))[:share]
        if len(ids) < share:
            raise RecipeError(
                f"the held-out {kind} text has {len(ids)} tokens, evaluate.task_params.fidelity_tokens asks "
                f"{share} of each kind: lower it"
            )
        texts[kind] = ids
    return texts


def screen_texts(texts: dict[str, list[int]], screen_tokens: int) -> dict[str, list[int]]:
    """The race's screen: the first `screen_tokens` of the texts, an equal share from each kind."""
    share = max(2, screen_tokens // len(texts))
    return {kind: ids[:share] for kind, ids in texts.items()}


def baseline_reference(runner, texts: dict[str, list[int]], cfg, measured: dict):
    """(the baseline's Reference, its identity): read from `measured` (the race computed or cached it
    on the same texts earlier in this run) where it is there, else computed now."""
    from optimize.evaluate import token_fidelity as tf

    identity = tf.reference_identity(texts, cfg.fidelity_window, cfg.fidelity_top_k)
    earlier = measured.get("fidelity_reference") or {}
    if earlier.get("identity") == identity:
        return earlier["reference"], identity
    log.info("fidelity: the baseline's log-probs over %d held-out tokens", sum(map(len, texts.values())))
    with stage(EVALUATION + "the baseline's fidelity reference"):
        return tf.reference(runner, texts, cfg.fidelity_window, cfg.fidelity_top_k), identity


def candidate_fidelity(reference, runner, texts: dict[str, list[int]], cfg, identity: str) -> dict:
    from optimize.evaluate import token_fidelity as tf

    with stage(EVALUATION + "the candidate's fidelity"):
        figures = tf.compare(reference, runner, texts, cfg.fidelity_window)
    figures.update(window=cfg.fidelity_window, top_k=cfg.fidelity_top_k, texts=identity)
    return figures


def task_scores(runner, tokens, cfg, folder: Path, label: str, measured: Optional[dict] = None, written=None) -> dict:
    """{"scores": {task: per-item scores}, "precision": what a PyTorch runner computed them in (None for
    other runtimes, which score as they serve)}: `measured`'s where its items are these (the race scored
    the baseline on them earlier), else scored now."""
    from optimize.tasks.lm_harness import standard_task_items

    earlier = (measured or {}).get("standard_tasks") or {}
    if written is not None and earlier.get("written") == _identity(written):
        return {"scores": earlier["scores"], "precision": earlier.get("precision")}
    precision = task_precision(runner, cfg.task_precision, label)
    scoring = runner.scored_in(precision) if precision else contextlib.nullcontext()
    with stage(EVALUATION + f"the {label}'s standard tasks"), scoring:
        scores = standard_task_items(runner, tokens, list(cfg.standard_tasks), folder, label)
    return {"scores": scores, "precision": precision}


def task_precision(runner, setting: str, label: str) -> Optional[str]:
    """What a PyTorch runner scores the standard tasks in: FP32, or (setting 'auto') the precision its
    weights are held in where this CPU computes that at least WORTH_IT times faster, measured on one
    of its layers. A right or wrong answer does not need the FP32 model's last bits (lm-eval scores
    a bf16 checkpoint in bf16); the token-level fidelity reference, which does, stays FP32. None for
    a runner that is not a PyTorch model."""
    if not hasattr(runner, "scored_in"):
        return None
    if setting == "float32":
        return "float32"
    from engines.pytorch.half_compute import faster_precision, held_precision

    held = held_precision(runner.model)
    chosen, speedup = faster_precision(runner.model)
    if held != "float32":
        log.info(
            "standard tasks %s: scored in %s (its %s computes %.1fx FP32's speed here)", label, chosen, held, speedup
        )
    return chosen


def _identity(written: dict) -> dict:
    return {name: entry["sha256"] for name, entry in written.items()}


def standard_tasks(metrics: dict, base, cand, tokens, cfg, scratch: Path, measured: dict) -> dict:
    """Both sides' scores on every standard task, the paired drops with their intervals and flips
    (metrics[candidate][standard_tasks]); returns what was evaluated, for the manifest."""
    from optimize.tasks.lm_harness import paired_tasks, standard_task_data

    folder = scratch / "standard_tasks"
    written = standard_task_data(cfg.standard_tasks, cfg.standard_limit, folder)
    base_side = task_scores(base, tokens, cfg, folder, "baseline", measured, written)
    cand_side = task_scores(cand, tokens, cfg, folder, "candidate")
    paired = paired_tasks(base_side["scores"], cand_side["scores"], cfg.bootstrap_resamples)
    paired["limit_setting"] = "evaluate.task_params.standard_limit"
    paired["scored_in"] = {"baseline": base_side["precision"], "candidate": cand_side["precision"]}
    metrics["candidate"]["standard_tasks"] = paired
    metrics["baseline"]["standard_tasks"] = {name: p["baseline"] for name, p in paired["tasks"].items()}
    return {"tasks": written, "identity": _identity(written)}
