"""KServe v2 / Triton HTTP protocol: health, server and model metadata, tensor inference, its parser.

Follows the Open Inference Protocol (kserve.github.io/website/docs/concepts/architecture/
data-plane/v2-protocol) including Triton's binary tensor extension, which tritonclient uses by
default: a JSON header of `Inference-Header-Content-Length` bytes followed by raw tensors.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engines import formats
from serve.body import arriving, read_body
from serve.encoder.datatypes import KSERVE_DTYPES, NUMPY_TO_KSERVE
from serve.encoder.model import run_encoder
from serve.errors import HTTPError, bad_request, not_found, too_large_batch, unprocessable
from serve.protocols.jsonbody import FastJSONResponse, array
from serve.protocols.openapi import INFER_ERRORS, errors, json_body, path_param, ref
from serve.protocols.parsing import get_bool, get_int, get_object, get_str, is_int, json_object
from serve.protocols.spec import ProtocolSpec
from serve.state import state_of

MODEL = "/v2/models/{name}"
VERSIONED = "/v2/models/{name}/versions/{version}"


def routes() -> list[Route]:
    return [
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        Route(MODEL, model_metadata),
        Route(VERSIONED, model_metadata),
        Route(MODEL + "/ready", model_ready),
        Route(VERSIONED + "/ready", model_ready),
        Route(MODEL + "/config", model_config),
        Route(VERSIONED + "/config", model_config),
        Route(MODEL + "/infer", infer, methods=["POST"]),
        Route(VERSIONED + "/infer", infer, methods=["POST"]),
    ]


def model_of(request: Request):
    """The served model's state, or 404 for another name or version."""
    state = state_of(request)
    name, version = request.path_params["name"], request.path_params.get("version")
    if name != state.name:
        raise not_found(f"unknown model {name!r}; this server serves {state.name!r}")
    if version not in (None, "", state.version):
        raise not_found(f"unknown version {version!r} of model {name!r}; available: {state.version!r}")
    return state


# --- health and metadata -------------------------------------------------------------------------


async def live(request: Request) -> Response:
    return health(state_of(request).health_problem(readiness=False))


async def ready(request: Request) -> Response:
    return health(state_of(request).health_problem(readiness=True))


def health(problem: str | None) -> Response:
    """200 with no body, or 503 saying why ({"error": ...}, as every /v2 error)."""
    return Response(status_code=200) if problem is None else JSONResponse({"error": problem}, status_code=503)


async def model_ready(request: Request) -> Response:
    return Response(status_code=200 if model_of(request).ready else 503)


async def server_metadata(request: Request) -> JSONResponse:
    from serve import __version__

    return JSONResponse({"name": "serve", "version": __version__, "extensions": ["binary_tensor_data"]})


async def model_metadata(request: Request) -> JSONResponse:
    state = model_of(request)
    inputs, outputs = tensor_metadata(state)
    manifest = state.manifest
    return JSONResponse(
        {
            "name": state.name,
            "versions": [state.version],
            "platform": platform(state),
            "inputs": inputs,
            "outputs": outputs,
            # Not part of the protocol (clients ignore extra keys): what was gated, and its verdict.
            "artifact": {
                "id": manifest.get("id"),
                "task": state.task,
                "precision": state.engine.get("precision"),
                "verdict": manifest.get("verdict"),
                "gate_passed": (manifest.get("gate") or {}).get("passed"),
            },
        }
    )


def platform(state) -> str:
    """The engine's platform name, as its format's row gives it."""
    row = formats.FORMATS.get(state.engine.get("format") or "")
    return row.platform if row else str(state.engine.get("format"))


def tensor_metadata(state) -> tuple[list[dict], list[dict]]:
    """From the loaded graph; before loading, from the manifest's engine inputs."""
    if state.model is not None and hasattr(state.model, "tensor_metadata"):
        return state.model.tensor_metadata()
    inputs = [
        {
            "name": i["name"],
            "datatype": "INT64" if i.get("type") == "tensor(int64)" else "FP32",
            "shape": [d if isinstance(d, int) else -1 for d in i.get("shape", [])],
        }
        for i in state.engine.get("inputs", [])
    ]
    return inputs, []


async def model_config(request: Request) -> JSONResponse:
    """Triton's model configuration (read by tools such as perf_analyzer)."""
    state = model_of(request)
    inputs, outputs = tensor_metadata(state)
    as_config = lambda t: {"name": t["name"], "data_type": "TYPE_" + t["datatype"], "dims": t["shape"][1:]}  # noqa: E731
    cfg = state.config
    return JSONResponse(
        {
            "name": state.name,
            "platform": platform(state),
            "max_batch_size": cfg.max_batch_size,
            "input": [as_config(t) for t in inputs],
            "output": [as_config(t) for t in outputs],
            "dynamic_batching": {"max_queue_delay_microseconds": int(cfg.max_queue_delay_ms * 1000)},
        }
    )


MAX_DIMS = 8
# Elements one shape may describe: a terabyte of data, far past any request body, and small enough
# that numpy's byte count (elements x 8) stays inside its index range.
MAX_ELEMENTS = 2**40

# --- parsing an inference request ----------------------------------------------------------------


@dataclass
class RequestedOutput:
    name: str
    binary: bool


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    outputs: list[RequestedOutput] | None  # None: every output of the model
    binary_output: bool  # request-level default for outputs (tritonclient's binary_data_output)
    id: str | None = None


def split_binary_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """Binary tensor extension: a JSON header of `Inference-Header-Content-Length` bytes, then raw tensors."""
    if header_length is None:
        return body, b""
    try:
        length = int(header_length)
    except ValueError:
        raise bad_request("Inference-Header-Content-Length must be an integer") from None
    if not 0 < length <= len(body):
        raise bad_request(f"Inference-Header-Content-Length {length} does not fit a body of {len(body)} bytes")
    return body[:length], body[length:]


def parse_infer_request(body: bytes, header_length: str | None = None) -> InferRequest:
    header, binary = split_binary_body(body, header_length)
    data = json_object(header)
    raw_inputs = data.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise bad_request("'inputs' must be a non-empty list of tensors", param="inputs")
    inputs, offset = {}, 0
    for i, raw in enumerate(raw_inputs):
        name, array, offset = parse_input_tensor(raw, i, binary, offset)
        if name in inputs:
            raise bad_request(f"input {name!r} is given twice", param="inputs")
        inputs[name] = array
    if offset != len(binary):
        raise bad_request(f"{len(binary) - offset} bytes of binary data are not claimed by any input")
    parameters = get_object(data, "parameters")
    request_id = data.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request("'id' must be a string", param="id")
    return InferRequest(
        inputs=inputs,
        outputs=parse_requested_outputs(data.get("outputs")),
        binary_output=get_bool(parameters, "binary_data_output"),
        id=request_id,
    )


def parse_shape(raw, where: str) -> list[int]:
    if not isinstance(raw, list) or len(raw) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in raw):
        raise bad_request(f"{where}: 'shape' must be a list of at most {MAX_DIMS} non-negative integers")
    # A zero dim makes the element count 0 whatever the others are, so [2**63, 0] would pass every
    # size check and then fail in numpy (past its index range): bound the dims as if zeros were ones.
    if math.prod(max(d, 1) for d in raw) > MAX_ELEMENTS:
        raise bad_request(f"{where}: 'shape' {raw} is too large: its non-zero dims multiply to over {MAX_ELEMENTS}")
    return raw


def parse_input_tensor(raw, index: int, binary: bytes, offset: int) -> tuple[str, np.ndarray, int]:
    where = f"inputs[{index}]"
    if not isinstance(raw, dict):
        raise bad_request(f"{where} must be an object")
    name = get_str(raw, "name", required=True)
    datatype = get_str(raw, "datatype", required=True)
    if datatype not in KSERVE_DTYPES:
        raise unprocessable(
            f"{where} ({name}): datatype {datatype!r} is not supported (one of {', '.join(KSERVE_DTYPES)})"
        )
    shape = parse_shape(raw.get("shape"), where)
    count = math.prod(shape)
    parameters = get_object(raw, "parameters", where)
    size = get_int(parameters, "binary_data_size", low=0)
    if size is not None:
        array, offset = binary_tensor(binary, offset, size, KSERVE_DTYPES[datatype], count, where)
    else:
        array = json_tensor(raw.get("data"), datatype, count, where)
    return name, array.reshape(shape), offset


def binary_tensor(binary: bytes, offset: int, size: int, dtype: np.dtype, count: int, where: str):
    if size != count * dtype.itemsize:
        raise bad_request(
            f"{where}: binary_data_size {size} does not match the shape ({count} x {dtype.itemsize} bytes)"
        )
    if offset + size > len(binary):
        raise bad_request(f"{where}: binary data ends early ({len(binary) - offset} of {size} bytes)")
    array = np.frombuffer(binary, dtype=dtype, count=count, offset=offset)
    return array.astype(dtype.newbyteorder("="), copy=True), offset + size


def json_tensor(data, datatype: str, count: int, where: str) -> np.ndarray:
    """Tensor data as JSON: a flat list in row-major order (nested lists are accepted too)."""
    if not isinstance(data, list):
        raise bad_request(f"{where}: 'data' must be a list (or use binary_data_size)")
    try:
        array = np.array(data)
    except (ValueError, OverflowError, RecursionError):
        raise bad_request(f"{where}: 'data' must be a list of numbers (nested lists must be rectangular)") from None
    kinds = {"BOOL": "b"}.get(datatype, "iu" if datatype[0] in "IU" else "iuf")
    if array.size and array.dtype.kind not in kinds:
        raise unprocessable(f"{where}: 'data' holds {array.dtype.kind!r}-kind values, not {datatype}")
    if array.size != count:
        raise unprocessable(f"{where}: 'data' has {array.size} elements but the shape needs {count}")
    target = KSERVE_DTYPES[datatype]
    if array.size and array.dtype.kind in "iu" and target.kind in "iu":
        info = np.iinfo(target)  # type: ignore[type-var]  # numpy's stubs: an integer dtype is checked above
        if array.min() < info.min or array.max() > info.max:
            raise unprocessable(f"{where}: values out of range for {datatype}")
    return array.astype(target.newbyteorder("=")).reshape(-1)


def parse_requested_outputs(raw) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise bad_request("'outputs' must be a list", param="outputs")
    outputs = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"outputs[{i}] must be an object", param="outputs")
        parameters = get_object(item, "parameters", f"outputs[{i}]")
        outputs.append(RequestedOutput(get_str(item, "name", required=True), get_bool(parameters, "binary_data")))
    return outputs


# --- inference -----------------------------------------------------------------------------------


async def infer(request: Request) -> Response:
    state = model_of(request)
    state.require_answers("tensors")
    model = state.batch_model()
    with arriving(state.batcher):
        body = await read_body(request, state.config.max_request_bytes)
        parsed = parse_infer_request(body, request.headers.get("inference-header-content-length"))
        item = model.from_tensors(parsed.inputs)
        if item.rows > state.config.max_inputs:
            raise too_large_batch(item.rows, state.config.max_inputs)
        wanted = requested_outputs(parsed, model.output_names)
    if "attention_mask" in item.inputs:  # an encoder's tokens (a tensor model has none to count)
        state.metrics.prompt_tokens.inc(int(item.inputs["attention_mask"].sum()))
    outputs = await run_encoder(state, item)
    return infer_response(state, parsed, wanted, outputs)


def requested_outputs(parsed, names: list[str]) -> list[tuple[str, bool]]:
    """[(output name, as binary)]: the ones asked for, or all of them."""
    if parsed.outputs is None:
        return [(name, parsed.binary_output) for name in names]
    unknown = [o.name for o in parsed.outputs if o.name not in names]
    if unknown:
        raise unprocessable(f"unknown outputs {unknown}; the model returns {names}")
    return [(o.name, o.binary or parsed.binary_output) for o in parsed.outputs]


def infer_response(state, parsed, wanted: list[tuple[str, bool]], outputs: dict[str, np.ndarray]) -> Response:
    tensors, blobs = [], []
    for name, binary in wanted:
        value = np.ascontiguousarray(outputs[name])
        tensor: dict[str, Any] = {
            "name": name,
            "datatype": NUMPY_TO_KSERVE[value.dtype.newbyteorder("<")],
            "shape": list(value.shape),
        }
        if binary:
            blob = value.astype(value.dtype.newbyteorder("<")).tobytes()
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = array(value.reshape(-1))
        tensors.append(tensor)
    # The protocol makes the id optional; KServe's own models (its clients and InferenceGraph) require
    # one, so a request without one gets a fresh one, as KServe's server answers.
    header = {"model_name": state.name, "model_version": state.version, "outputs": tensors}
    header["id"] = parsed.id if parsed.id is not None else uuid.uuid4().hex
    if not blobs:
        return FastJSONResponse(header)
    head = json.dumps(header, separators=(",", ":")).encode()
    return Response(
        head + b"".join(blobs),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )


# --- the protocol: routes, OpenAPI paths, error body ----------------------------------------------


def kserve_error_body(error: HTTPError) -> dict:
    """KServe clients read {"error": "..."}."""
    return {"error": error.message}


def kserve_paths(state) -> dict:
    name = [path_param("name", state.name)]
    versioned = name + [path_param("version", state.version)]

    def get(summary, params, ok, *codes):
        return {
            "get": {
                "tags": ["kserve"],
                "summary": summary,
                "parameters": params,
                "responses": {"200": ok, **errors("KServeError", *codes)},
            }
        }

    def health(summary):
        return {
            "get": {
                "tags": ["kserve"],
                "summary": summary,
                "responses": {"200": {"description": "yes"}, "503": {"description": "not yet"}},
            }
        }

    metadata = {"description": "model metadata", **json_body(ref("ModelMetadata"))}
    ready = {"description": "ready"}
    config = {"description": "Triton model configuration", **json_body({"type": "object"})}
    paths = {
        "/v2": get("server metadata", [], {"description": "server metadata", **json_body(ref("ServerMetadata"))}),
        "/v2/health/live": health("the process is up (503 once its engine failed and could not be restarted)"),
        "/v2/health/ready": health("the model is loaded (503 until then)"),
    }
    for prefix, params in (("/v2/models/{name}", name), ("/v2/models/{name}/versions/{version}", versioned)):
        paths[prefix] = get("model metadata", params, metadata, 404, 405)
        paths[prefix + "/ready"] = get("model readiness", params, ready, 404, 405, 503)
        paths[prefix]["get"]["responses"]["404"]["description"] = "unknown model or version"
        paths[prefix + "/ready"]["get"]["responses"]["503"] = {"description": "not ready"}
        paths[prefix + "/config"] = get("Triton model configuration", params, config, 404, 405)
        paths[prefix + "/infer"] = {
            "post": {
                "tags": ["kserve"],
                "summary": "inference on JSON tensors (binary tensor extension accepted too)",
                "parameters": params,
                "requestBody": {"required": True, **json_body(ref("InferRequest"))},
                "responses": {
                    "200": {"description": "output tensors", **json_body(ref("InferResponse"))},
                    **errors("KServeError", *INFER_ERRORS),
                },
            }
        }
    return paths


SPEC = ProtocolSpec("kserve", routes, kserve_paths, kserve_error_body, prefixes=("/v2",))
