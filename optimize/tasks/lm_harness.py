"""lm-eval on any causal-LM runner: a local multiple-choice task made from held-out prose (runs
offline), standard task names where the dataset hub is reachable, scored through the runner's
log_likelihood, the same scoring perplexity uses."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

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


def greedy_ids(runner, prompt_ids, new_tokens: int) -> list[int]:
    """Greedy continuation token ids from either kind of runner."""
    if hasattr(runner, "greedy"):
        return runner.greedy(prompt_ids, new_tokens)
    from engines.generation import Sampling

    return [t for t, _ in runner.generate([int(i) for i in prompt_ids], Sampling(max_new_tokens=new_tokens))]


def lm_adapter(runner, tokens):
    """An lm-eval LM over any runner with log_likelihood (the same scoring perplexity uses)."""
    from lm_eval.api.model import LM

    class Adapter(LM):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            results = []
            for request in requests:
                context, continuation = request.args
                head, tail = tokens(context), tokens(continuation)
                logprobs = runner.log_likelihood(head + tail, start=len(head))
                results.append((float(logprobs.sum()), False))  # greediness is not used by acc
            return results

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
