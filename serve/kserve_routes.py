"""KServe v2 / Triton HTTP protocol: health, server and model metadata, tensor inference.

Follows the Open Inference Protocol (kserve.github.io/website/docs/concepts/architecture/
data-plane/v2-protocol) including Triton's binary tensor extension, which tritonclient uses by
default: a JSON header of `Inference-Header-Content-Length` bytes followed by raw tensors.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engines import formats
from serve.body import arriving, read_body
from serve.errors import HTTPError, not_found, too_large_batch, unprocessable
from serve.jsonbody import FastJSONResponse, array
from serve.openapi import INFER_ERRORS, errors, json_body, path_param, ref
from serve.protocol import NUMPY_TO_KSERVE, parse_infer_request
from serve.spec import ProtocolSpec
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


# --- inference -----------------------------------------------------------------------------------


async def infer(request: Request) -> Response:
    state = model_of(request)
    state.require_answers("tensors")
    state.require_ready()
    with arriving(state.batcher):
        body = await read_body(request, state.config.max_request_bytes)
        parsed = parse_infer_request(body, request.headers.get("inference-header-content-length"))
        item = state.model.from_tensors(parsed.inputs)
        if item.rows > state.config.max_inputs:
            raise too_large_batch(item.rows, state.config.max_inputs)
        wanted = requested_outputs(parsed, state.model.output_names)
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


async def run_encoder(state, item) -> dict[str, np.ndarray]:
    """Submit to the batcher; a request larger than one batch goes in batch-sized pieces (each kind
    of item knows how it may be cut: a tensor model's request whose batch is not on axis 0 stays whole)."""
    size, timeout = state.config.max_batch_size, state.config.timeout_s
    if item.rows > state.config.max_inputs:  # every route: the cap on rows per request
        raise too_large_batch(item.rows, state.config.max_inputs)
    pieces = item.split(size) if item.rows > size else [item]
    if len(pieces) == 1:
        return await state.batcher.submit(item, item.rows, timeout)
    # All pieces are queued or none is (429), and a refused, timed-out or abandoned request's pieces
    # leave the queue at once: none of them reaches the model.
    results = await state.batcher.submit_many([(p, p.rows) for p in pieces], timeout)
    return {name: np.concatenate([r[name] for r in results]) for name in results[0]}


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
