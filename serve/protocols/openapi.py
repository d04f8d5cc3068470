"""The OpenAPI 3.0 document served at /openapi.json, written out by hand.

It describes what this server accepts and returns, status codes included, so that a
schema-driven tester (schemathesis, tests/serve/test_serve_schema.py) can generate requests from it and
check every response against it. Model names appear as examples; other names answer 404.

Each protocol writes its own paths (its SPEC, serve/protocols/spec.py); this module assembles those of
the protocols the app serves (handed to it in the state) and holds what they share: the helpers below
and the component schemas they refer to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serve.state import ServeState


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def json_body(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def errors(kind: str, *codes: int) -> dict:
    """Error responses: KServe's {"error": "..."} under /v2, OpenAI's {"error": {...}} under /v1."""
    reasons = {
        400: "malformed request",
        401: "missing or wrong API key",
        404: "unknown model or version",
        405: "method not allowed",
        413: "body too large",
        415: "unsupported Content-Encoding",
        422: "inputs the model cannot take",
        429: "queue full (see Retry-After)",
        503: "model loading or unavailable",
        504: "timed out",
    }
    return {str(c): {"description": reasons[c], **json_body(ref(kind))} for c in codes}


INFER_ERRORS = (400, 404, 405, 413, 415, 422, 429, 503, 504)
OPENAI_ERRORS = (400, 404, 405, 413, 415, 422, 429, 503, 504)
NAME_PATTERN = "^[A-Za-z0-9_.-]+$"


def path_param(name: str, example: str) -> dict:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": NAME_PATTERN, "example": example},
    }


def openapi_document(state: ServeState) -> dict:
    """The document of the protocols the app was built with (state.protocols, serve/app.py)."""
    doc: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": f"serve: {state.name}",
            "version": "1",
            "description": "KServe v2 / Triton HTTP and OpenAI-compatible endpoints for one gated artifact.",
        },
        "paths": {path: item for spec in state.protocols for path, item in spec.paths(state).items()},
        "components": {"schemas": SCHEMAS},
    }
    if state.config.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        for item in doc["paths"].values():
            for operation in item.values():
                operation["responses"].update(errors(error_kind_of(operation), 401))
    return doc


def error_kind_of(operation: dict) -> str:
    return "KServeError" if "kserve" in operation.get("tags", []) else "OpenAIError"


TENSOR_META: dict[str, Any] = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
    },
}
DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]
TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
STOP = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}},
    ],
    "nullable": True,
}
SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "n": {"type": "integer", "enum": [1], "nullable": True},
    "stream": {"type": "boolean", "nullable": True},
    "stop": STOP,
    "seed": {"type": "integer", "nullable": True},
    "stream_options": {
        "type": "object",
        "nullable": True,
        "properties": {"include_usage": {"type": "boolean", "nullable": True}},
    },
}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}
OPENAI_OBJECT = lambda kind, **props: {
    "type": "object",
    "required": ["object"],
    "properties": {
        "object": {"type": "string", "enum": [kind]},
        **props,
    },
}


def COMPLETION_RESPONSE(kind: str, field: str, schema: dict) -> dict:  # noqa: N802  # named like the schemas
    """A completion's response: its choices each carry `field` (the text, or the chat message)."""
    choice = {
        "type": "object",
        "required": [field, "finish_reason"],
        "properties": {field: schema, "finish_reason": {"type": "string", "enum": ["stop", "length"]}},
    }
    return OPENAI_OBJECT(kind, id={"type": "string"}, usage=USAGE, choices={"type": "array", "items": choice})


SCHEMAS: dict[str, Any] = {
    "KServeError": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "OpenAIError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": "string", "nullable": True},
                    "code": {"nullable": True},
                },
            }
        },
    },
    "ServerMetadata": {
        "type": "object",
        "required": ["name", "version", "extensions"],
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}},
        },
    },
    "ModelMetadata": {
        "type": "object",
        "required": ["name", "platform", "inputs", "outputs"],
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": TENSOR_META},
            "outputs": {"type": "array", "items": TENSOR_META},
        },
    },
    "InferRequest": {
        "type": "object",
        "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object"},
            "inputs": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["name", "datatype", "shape"],
                    "properties": {
                        "name": {"type": "string"},
                        "datatype": {"type": "string", "enum": DATATYPES},
                        "shape": {"type": "array", "maxItems": 8, "items": {"type": "integer", "minimum": 0}},
                        "parameters": {"type": "object"},
                        "data": {"type": "array", "items": {"type": "number"}},
                    },
                },
            },
            "outputs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "parameters": {"type": "object"}},
                },
            },
        },
    },
    "InferResponse": {
        "type": "object",
        "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {
                "type": "array",
                "items": {**TENSOR_META, "properties": {**TENSOR_META["properties"], "data": {"type": "array"}}},
            },
        },
    },
    "EmbeddingsRequest": {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string"},
            "input": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    TOKENS,
                    {"type": "array", "minItems": 1, "items": TOKENS},
                ]
            },
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "dimensions": {"type": "integer", "minimum": 1},
            "user": {"type": "string"},
        },
    },
    "EmbeddingsResponse": OPENAI_OBJECT(
        "list",
        model={"type": "string"},
        usage=USAGE,
        data={
            "type": "array",
            "items": OPENAI_OBJECT(
                "embedding",
                index={"type": "integer"},
                embedding={"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
            ),
        },
    ),
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {
                "oneOf": [
                    {"type": "string"},
                    TOKENS,  # or a batch of exactly one of either
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": TOKENS},
                ]
            },
            **SAMPLING,
        },
    },
    "ChatRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["role"],
                    "properties": {
                        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                        "content": {
                            "nullable": True,
                            "oneOf": [
                                {"type": "string"},
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["type", "text"],
                                        "properties": {
                                            "type": {"type": "string", "enum": ["text"]},
                                            "text": {"type": "string"},
                                        },
                                    },
                                },
                            ],
                        },
                    },
                },
            },
            "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
            **SAMPLING,
        },
    },
    "CompletionResponse": COMPLETION_RESPONSE("text_completion", "text", {"type": "string"}),
    "ChatResponse": COMPLETION_RESPONSE(
        "chat.completion", "message", {"type": "object", "required": ["role", "content"]}
    ),
    "Model": OPENAI_OBJECT("model", id={"type": "string"}, owned_by={"type": "string"}),
    "ModelList": OPENAI_OBJECT("list", data={"type": "array", "items": {"$ref": "#/components/schemas/Model"}}),
}
