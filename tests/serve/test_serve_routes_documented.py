"""/openapi.json describes every route the app answers, and nothing it does not: both come from the
same protocol objects (serve/protocols/spec.py), and this compares what Starlette routes with the document."""

from __future__ import annotations

from starlette.routing import Route

from serve.app import create_app, protocols
from serve.protocols.openapi import openapi_document
from serve.protocols.spec import error_body_for

DOCUMENTED_METHODS = {"get", "post", "put", "patch", "delete"}  # HEAD comes with GET, undocumented


def app_operations(app) -> set[tuple[str, str]]:
    operations = set()
    for route in app.routes:
        assert isinstance(route, Route), f"{route!r} is not a plain route"
        methods = {m.lower() for m in (route.methods or {"GET"})} & DOCUMENTED_METHODS
        operations.update((route.path, method) for method in methods)
    return operations


def document_operations(document: dict) -> set[tuple[str, str]]:
    return {(path, method) for path, item in document["paths"].items() for method in item}


def test_every_route_is_in_the_document_and_every_path_is_routed(tmp_path):
    app = create_app(tmp_path, manifest={"recipe": {"name": "m"}})
    routed, documented = app_operations(app), document_operations(openapi_document(app.state.serve))
    assert routed == documented
    for operation in [("/predict", "post"), ("/metrics", "get"), ("/openapi.json", "get"), ("/v2/health/live", "get")]:
        assert operation in routed


def test_each_protocol_answers_errors_with_its_own_body():
    from serve.errors import HTTPError

    specs = protocols()
    error = HTTPError(404, "gone", "not_found_error")
    assert error_body_for("/v2/models/x", specs)(error) == {"error": "gone"}
    for path in ("/v1/completions", "/predict", "/metrics", "/nowhere"):
        assert error_body_for(path, specs)(error)["error"]["message"] == "gone"
