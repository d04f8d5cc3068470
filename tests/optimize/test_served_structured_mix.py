"""The served gate's JSON-schema request mix, without a server: which requests are constrained, how a
constrained reply is judged (valid, cut by max_tokens, invalid), the check it implies, and the
recipe keys refused at plan time."""

from __future__ import annotations

import json

import pytest

from optimize import gate
from optimize.errors import RecipeError
from optimize.evaluate.served import (
    STRUCTURED_SCHEMA,
    Result,
    carries_schema,
    structured_summary,
    structured_verdict,
)
from optimize.tasks import lm_served


def test_the_share_spreads_constrained_requests_evenly():
    assert [carries_schema(i, 0.5) for i in range(6)] == [False, True] * 3
    assert sum(carries_schema(i, 0.25) for i in range(16)) == 4
    assert all(carries_schema(i, 1.0) for i in range(10)) and not any(carries_schema(i, 0.0) for i in range(10))
    assert sum(carries_schema(i, 0.1) for i in range(10)) == 1


def _reply(text: str, finish: str = "stop", schema=STRUCTURED_SCHEMA, status: int = 200) -> Result:
    return Result(text=text, finish_reason=finish, schema=schema, status=status)


def test_a_constrained_reply_is_valid_cut_or_invalid():
    assert structured_verdict(_reply(json.dumps({"name": "ab", "count": 3}))) == "valid"
    assert structured_verdict(_reply('{"name":"ab","cou', "length")) == "cut"  # not whole: not judged
    assert structured_verdict(_reply('{"name":"ab","cou')) == "invalid"  # stopped, and not JSON
    assert structured_verdict(_reply('{"name":"toolongname","count":3}')) == "invalid"  # maxLength 8
    assert structured_verdict(_reply('{"name":"ab","count":3,"x":1}', "length")) == "cut"
    assert structured_verdict(_reply('{"name":"ab"}')) == "invalid"  # count is required


def test_the_summary_counts_what_was_answered():
    results = [
        _reply('{"name":"a","count":1}'),
        _reply('{"name":"a","count":-1}'),
        _reply('{"na', "length"),
        _reply("", status=400),
        Result(text="free text", finish_reason="stop"),  # not constrained
    ]
    summary = structured_summary(results, 0.8)
    assert summary == {
        "share": 0.8,
        "requests": 4,
        "answered": 3,
        "valid": 1,
        "cut": 1,
        "invalid": 1,
        "invalid_examples": ['{"name":"a","count":-1}'],
    }


def _served(**structured) -> dict:
    base = {"valid": 4, "cut": 0, "invalid": 0, "requests": 4}
    return {"served": {"failed": 0, "requests": 8, "other_cpu_share": 0.0, "structured": {**base, **structured}}}


def test_a_structured_share_implies_a_check_that_fails_on_any_invalid_reply():
    share = {"served_structured_share": 0.5}
    (check,) = gate.judge({}, _served(), share).checks
    assert check.name == "max_served_invalid_structured" and check.threshold == 0 and check.passed
    assert "4 valid, 0 cut by max_tokens" in check.note
    (check,) = gate.judge({}, _served(valid=3, invalid=1), share).checks
    assert check.value == 1 and not check.passed
    (check,) = gate.judge({}, _served(valid=0, cut=4), share).checks  # nothing judged: not measured
    assert check.value is None and not check.passed
    failed = _served()
    failed["served"]["failed"] = 1
    assert not gate.judge({}, failed, share).passed
    (check,) = gate.judge({}, _served(valid=3, invalid=1), {**share, "max_served_invalid_structured": 1}).checks
    assert check.passed  # a recipe may tolerate some
    assert gate.judge({}, _served(valid=3, invalid=1), {"served_structured_share": 0.0}).checks == ()
    assert "max_served_invalid_structured" not in gate.untimed_keys()  # the race cannot judge it
    assert gate.served_keys() == set(lm_served.SERVED_THRESHOLDS)


def test_the_served_load_takes_the_share_and_refuses_a_share_out_of_range():
    from optimize.workload import BatchPoint, RequestPoint, Workload

    workload = Workload((BatchPoint(1, 1.0),), (RequestPoint(16, 8, 1.0),))
    assert lm_served.settings({"served_structured_share": 0.5}, workload).structured_share == 0.5
    assert lm_served.settings({}, workload).structured_share == 0.0
    assert lm_served.asked({"served_structured_share": 0.5}) and not lm_served.asked({"served_structured_share": 0})
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(RecipeError, match="gate.served_structured_share"):
            lm_served.settings({"served_structured_share": bad}, workload)


def test_the_table_says_how_many_constrained_replies_were_invalid():
    served = {"clients": 2, "prompt_tokens": 16, "requested_tokens": 48, "requests": 8, "failed": 0}
    served["structured"] = {"requests": 4, "valid": 3, "cut": 1, "invalid": 0}
    rows = lm_served.table_rows(served)
    note = "4 of 8 requests constrained to a JSON schema, 1 cut by max_tokens"
    assert rows[-1] == ["served constrained replies invalid", "", "0", note]
    assert all("constrained" not in r[0] for r in lm_served.table_rows({**served, "structured": None}))


def test_the_invalid_reply_check_without_a_structured_share_is_refused_at_plan_time(tmp_path):
    from optimize import pipeline
    from tests.support.context import compose_recipe

    cfg = compose_recipe(
        "recipe=smollm2_int4_cpu", "gate.max_served_invalid_structured=0", f"output_dir={tmp_path / 'out'}"
    )
    with pytest.raises(RecipeError, match="set gate.served_structured_share"):
        pipeline.plan(cfg, tmp_path)
    cfg = compose_recipe("recipe=smollm2_int4_cpu", "gate.served_structured_share=2", f"output_dir={tmp_path / 'o'}")
    with pytest.raises(RecipeError, match="gate.served_structured_share=2"):
        pipeline.plan(cfg, tmp_path)
