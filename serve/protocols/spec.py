"""One object per protocol the server speaks: its routes, its OpenAPI paths, and the error body its
clients read. The app is assembled from `protocols()` (serve/app.py) and /openapi.json is built from
the same list, which the app hands to the state (serve/protocols/openapi.py), so a route cannot be
answered without being documented.

A protocol is a module of serve/protocols/ (kserve, openai, tokenize, predict, server) with one `SPEC`;
adding one is that module plus its line in serve.app.protocols().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from starlette.routing import Route

    from serve.errors import HTTPError
    from serve.state import ServeState


@dataclass(frozen=True)
class ProtocolSpec:
    name: str
    routes: Callable[[], list[Route]]
    paths: Callable[[ServeState], dict[str, Any]]  # OpenAPI path items, by path
    error_body: Callable[[HTTPError], dict]  # what a refusal on its paths answers
    # Paths under these prefixes take this protocol's error body even where no route matches (a 404
    # under /v2 answers as KServe does); every other path takes the default protocol's.
    prefixes: tuple[str, ...] = ()


def error_body_for(path: str, specs: list[ProtocolSpec]) -> Callable[[HTTPError], dict]:
    """The error body of the protocol that owns `path`; OpenAI's (serve.errors.openai_error_body)
    where none claims it by prefix."""
    from serve.errors import openai_error_body

    for spec in specs:
        if any(path.startswith(prefix) for prefix in spec.prefixes):
            return spec.error_body
    return openai_error_body
