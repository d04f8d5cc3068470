"""The OpenAPI document at /openapi.json, exercised by schemathesis against real subprocesses:
requests generated from the schema (valid and deliberately invalid), every response checked for
no server errors, documented status codes and content types, and bodies that match the schema.

(schemathesis's pytest plugin does not run under pytest 9, so each operation's strategy is
driven with hypothesis directly: the same generation and the same checks.)"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation.modes import GenerationMode

from tests.support.serve import running_server

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module", params=["encoder", "causal_lm"])
def served_schema(request):
    artifact = request.getfixturevalue("encoder_artifact" if request.param == "encoder" else "tiny_llm_artifact")
    with running_server(artifact, "--max-tokens", "16", "--timeout-s", "20") as server:
        yield schemathesis.openapi.from_url(server.url + "/openapi.json")


def operations(schema):
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_conforms(served_schema, mode):
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    tested = []
    for operation in operations(served_schema):
        if mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET" and not operation.path_parameters:
            continue  # nothing to make invalid

        @given(operation.as_strategy(generation_mode=mode))
        @EXAMPLES
        def exercise(case):
            case.call_and_validate(checks=checks, timeout=30)

        exercise()
        tested.append(f"{operation.method.upper()} {operation.path}")
    assert any("infer" in t for t in tested) and any("completions" in t for t in tested)
