"""One object per protocol the server speaks: its routes, its OpenAPI paths, and the error body its
clients read. The app is assembled from `protocols()` (serve/app.py) and /openapi.json is built from
the same list (serve/openapi.py), so a route cannot be answered without being documented.

A protocol is a module (serve/kserve_routes.py, serve/openai_routes.py, serve/tokenize_routes.py,
serve/predict_routes.py, serve/misc_routes.py) with one `SPEC`; adding one is that module plus its line in PROTOCOLS.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from starlette.routing import Route

    from serve.errors import HTTPError
    from serve.state import ServeState

# In the order the app routes them (and the document lists them).
PROTOCOLS = (
    "serve.kserve_routes",
    "serve.openai_routes",
    "serve.tokenize_routes",
    "serve.predict_routes",
    "serve.misc_routes",
)


@dataclass(frozen=True)
class ProtocolSpec:
    name: str
    routes: Callable[[], list[Route]]
    paths: Callable[[ServeState], dict[str, Any]]  # OpenAPI path items, by path
    error_body: Callable[[HTTPError], dict]  # what a refusal on its paths answers
    # Paths under these prefixes take this protocol's error body even where no route matches (a 404
    # under /v2 answers as KServe does); every other path takes the default protocol's.
    prefixes: tuple[str, ...] = ()


def protocols() -> list[ProtocolSpec]:
    """Every protocol's SPEC, imported on first use (the routes modules import Starlette and numpy)."""
    return [importlib.import_module(module).SPEC for module in PROTOCOLS]


def error_body_for(path: str, specs: list[ProtocolSpec]) -> Callable[[HTTPError], dict]:
    """The error body of the protocol that owns `path`; OpenAI's (serve.errors.openai_error_body)
    where none claims it by prefix."""
    from serve.errors import openai_error_body

    for spec in specs:
        if any(path.startswith(prefix) for prefix in spec.prefixes):
            return spec.error_body
    return openai_error_body
