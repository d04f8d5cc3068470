"""Errors that become HTTP responses.

Every refusal the server makes is one of these: a status code, a message a person can act on, and
an error type. The app turns it into the JSON body the caller's protocol expects (each protocol's
`error_body`, serve/protocols/spec.py: KServe-style `{"error": "..."}` under /v2, OpenAI-style
`{"error": {...}}` everywhere else).
"""

from __future__ import annotations


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = headers or {}
        self.param = param


def openai_error_body(error: HTTPError) -> dict:
    """OpenAI clients read {"error": {message, type, param, code}}; the body of every path no
    protocol claims by prefix."""
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.status}}


def bad_request(message: str, param: str | None = None) -> HTTPError:
    """The body is not valid JSON or does not follow the protocol's schema."""
    return HTTPError(400, message, param=param)


def unprocessable(message: str, param: str | None = None) -> HTTPError:
    """Well-formed, but the model cannot take it (tensor dtype, shape, name, token range)."""
    return HTTPError(422, message, param=param)


def not_found(message: str) -> HTTPError:
    return HTTPError(404, message, kind="not_found_error")


def too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body exceeds the limit of {limit} bytes", kind="request_too_large")


def busy(retry_after_s: int = 1) -> HTTPError:
    return HTTPError(
        429,
        "the request queue is full; retry later",
        kind="rate_limit_error",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, retry_after_s: int = 1) -> HTTPError:
    return HTTPError(503, message, kind="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def timed_out(timeout_s: float) -> HTTPError:
    return HTTPError(504, f"the request did not finish within {timeout_s:g} s", kind="timeout")


def too_large_batch(rows: int, limit: int) -> HTTPError:
    """More rows (texts, token arrays, tensor rows) in one request than the server takes."""
    return HTTPError(
        413,
        f"the request has {rows} rows; at most {limit} per request (--max-inputs)",
        kind="request_too_large",
        param="input",
    )
