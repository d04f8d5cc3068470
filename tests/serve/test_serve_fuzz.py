"""Property-based fuzzing of the request parsers: whatever arrives, the answer is a request the
server can act on or an HTTPError with a 4xx status, never another exception (a 500). And of the
command line: whatever arguments `python -m serve` is given, it parses them or exits 2 with one
line `error: ...` (0 for --help), never a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from serve.encoder.datatypes import KSERVE_DTYPES
from serve.errors import HTTPError
from serve.llm.stops import StopMatcher
from serve.protocols.kserve import parse_infer_request
from serve.protocols.openai import parse_chat_request, parse_completion_request, parse_embeddings_request
from tests.support.serve import ROOT

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Requests with many optional fields are slow to generate: fewer examples, same coverage of fields.
FUZZ_WIDE = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=8,
)


def refused_cleanly(call) -> None:
    try:
        call()
    except HTTPError as exc:
        assert 400 <= exc.status < 500, exc.status
        assert exc.message


@FUZZ
@given(st.binary(max_size=300), st.one_of(st.none(), st.text(max_size=6)))
def test_infer_parser_on_arbitrary_bytes(body, header_length):
    refused_cleanly(lambda: parse_infer_request(body, header_length))


def tensor_like():
    shape = st.lists(st.integers(-2, 4), max_size=3) | json_values
    data = (
        st.lists(
            st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.booleans() | st.text(max_size=3), max_size=12
        )
        | json_values
    )
    return st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(["input_ids", "attention_mask"]) | json_values,
            "datatype": st.sampled_from(list(KSERVE_DTYPES) + ["BYTES", "int64"]) | json_values,
            "shape": shape,
            "data": data,
            "parameters": st.fixed_dictionaries({}, optional={"binary_data_size": st.integers(-1, 64) | json_values}),
        },
    )


@FUZZ_WIDE
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "inputs": st.lists(tensor_like(), max_size=3) | json_values,
            "outputs": st.lists(
                st.fixed_dictionaries({}, optional={"name": json_values, "parameters": json_values}), max_size=2
            )
            | json_values,
            "parameters": json_values,
            "id": json_values,
        },
    ),
    st.binary(max_size=64),
    st.booleans(),
)
def test_infer_parser_on_structured_requests(request, binary, use_binary):
    header = json.dumps(request).encode()
    body = header + binary if use_binary else header
    length = str(len(header)) if use_binary else None
    refused_cleanly(lambda: parse_infer_request(body, length))


@FUZZ
@given(
    st.sampled_from(["INT64", "INT32", "FP32", "FP16", "BOOL", "UINT8"]),
    st.lists(st.integers(1, 4), min_size=1, max_size=3),
    st.booleans(),
    st.data(),
)
def test_valid_tensors_round_trip_exactly(datatype, shape, binary, data):
    dtype = KSERVE_DTYPES[datatype]
    if dtype.kind == "b":
        values = data.draw(st.lists(st.booleans(), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = data.draw(
            st.lists(
                st.integers(int(info.min), int(info.max)), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))
            )
        )
    else:
        values = data.draw(
            st.lists(
                st.floats(-1e4, 1e4, width=16 if datatype == "FP16" else 32),
                min_size=int(np.prod(shape)),
                max_size=int(np.prod(shape)),
            )
        )
    array = np.array(values, dtype=dtype).reshape(shape)
    tensor = {"name": "x", "datatype": datatype, "shape": shape}
    if binary:
        blob = array.tobytes()
        tensor["parameters"] = {"binary_data_size": len(blob)}
        header = json.dumps({"inputs": [tensor]}).encode()
        parsed = parse_infer_request(header + blob, str(len(header)))
    else:
        tensor["data"] = array.reshape(-1).tolist()
        parsed = parse_infer_request(json.dumps({"inputs": [tensor]}).encode())
    got = parsed.inputs["x"]
    assert got.dtype == dtype and got.shape == tuple(shape)
    np.testing.assert_array_equal(got, array)


openai_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("m") | json_values,
        "input": json_values | st.lists(st.integers(-5, 40000), max_size=4) | st.text(max_size=10),
        "prompt": json_values | st.text(max_size=10),
        "messages": st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "role": st.sampled_from(["user", "system", "robot"]) | json_values,
                    "content": json_values
                    | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": json_values}), max_size=2),
                },
            ),
            max_size=3,
        )
        | json_values,
        "max_tokens": json_values,
        "max_completion_tokens": json_values,
        "temperature": json_values,
        "top_p": json_values,
        "n": json_values,
        "stream": json_values,
        "stop": json_values,
        "seed": json_values,
        "stream_options": json_values,
        "encoding_format": json_values,
        "dimensions": json_values,
        "logprobs": json_values,
        "echo": json_values,
    },
)


@FUZZ_WIDE
@given(openai_fields)
def test_openai_parsers_accept_or_refuse_with_4xx(data):
    refused_cleanly(lambda: parse_embeddings_request(data, max_inputs=8))
    refused_cleanly(lambda: parse_completion_request(data))
    refused_cleanly(lambda: parse_chat_request(data))


@FUZZ
@given(st.lists(st.text(max_size=4), max_size=12), st.lists(st.text(min_size=1, max_size=4), max_size=3))
def test_stop_matcher_emits_exactly_the_text_before_the_first_stop(pieces, stops):
    matcher = StopMatcher(stops)
    emitted = ""
    for piece in pieces:
        emitted += matcher.feed(piece)
        if matcher.stopped:
            break
    emitted += matcher.flush()
    full = "".join(pieces)
    cuts = [full.find(s) for s in stops if s in full]
    assert emitted == (full[: min(cuts)] if cuts else full)


# --- the command line ------------------------------------------------------------------------------

FLAGS = [
    "--host",
    "--port",
    "--model-name",
    "--max-batch-size",
    "--max-queue-delay-ms",
    "--max-queue",
    "--timeout-s",
    "--max-request-bytes",
    "--max-inputs",
    "--max-prompt-tokens",
    "--max-tokens",
    "--header-timeout-s",
    "--body-timeout-s",
    "--max-connections",
    "--threads",
    "--ort-spinning",
    "--api-key",
    "--open-health-metrics",
    "--allow-modified",
    "--allow-failed-gate",
    "--key",
    "--require-signature",
    "--log-level",
    "--help",
]
HOSTILE_VALUES = [
    "",
    " ",
    "\t",
    "0",
    "-1",
    "1e3",
    "nan",
    "-nan",
    "inf",
    "-inf",
    "1e309",
    "0x10",
    "1_000",
    "65536",
    "9" * 5000,  # past int()'s 4300 digits
    str(2**63),
    "--",
    "-",
    "--port=",
    "line\nbreak",
    "\x1b[31mred",
    "é",
    "\u202e",
]
# Text a command line can carry: no NUL, no lone surrogates (those cannot reach a process's argv).
arg_text = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=12)
argument = st.sampled_from(FLAGS) | st.sampled_from(HOSTILE_VALUES) | arg_text
FUZZ_ARGV = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_one_error_line(code, stderr: str) -> None:
    assert code in (0, 2), (code, stderr)
    if code == 2:
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr


@FUZZ_ARGV
@given(st.lists(argument, max_size=8))
def test_argument_parsing_parses_or_refuses_in_one_line(argv):
    from serve.__main__ import build_parser
    from serve.config import resolve

    out, err = io.StringIO(), io.StringIO()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            code = exc.code
    if code is None:  # parsed: the settings it makes must be usable as they are
        config = resolve(vars(args), {})
        assert 0 <= args.port <= 65535 and config.timeout_s > 0 and config.body_timeout_s > 0
        assert config.api_key is None or (config.api_key.strip() and config.api_key == config.api_key.strip())
        return
    assert_one_error_line(code, err.getvalue())


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(argument.filter(lambda a: a != "--help"), min_size=1, max_size=6))
@example(["stray\nargument"])  # quoted in the message: it must not break the line
def test_the_command_refuses_hostile_arguments_in_one_line(argv):
    """The real process, parse and checks only: the artifact does not exist, so nothing is served."""
    env = {k: v for k, v in os.environ.items() if k != "SERVE_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "serve", "/nonexistent/artifact", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert_one_error_line(proc.returncode, proc.stderr)
