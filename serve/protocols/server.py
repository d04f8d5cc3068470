"""The server's own routes, beside the protocols: Prometheus metrics and the OpenAPI document."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve.errors import openai_error_body
from serve.protocols.openapi import json_body, openapi_document
from serve.protocols.spec import ProtocolSpec
from serve.state import state_of


def routes() -> list[Route]:
    return [Route("/metrics", metrics_route), Route("/openapi.json", openapi_route)]


async def metrics_route(request: Request) -> Response:
    body, content_type = state_of(request).metrics.render()
    return Response(body, media_type=content_type)


async def openapi_route(request: Request) -> JSONResponse:
    return JSONResponse(openapi_document(state_of(request)))


def misc_paths(state) -> dict:
    return {
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {"description": "text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "responses": {"200": {"description": "OpenAPI 3.0", **json_body({"type": "object"})}},
            }
        },
    }


SPEC = ProtocolSpec("misc", routes, misc_paths, openai_error_body)
