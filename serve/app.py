"""The ASGI app: state, the gatekeeping middleware, health, metrics, and route wiring.

HTTP stack: Starlette on uvicorn. Starlette is small enough to read (pure Python, one dependency,
anyio), has real streaming responses for server-sent events and a lifespan hook for loading and
draining; uvicorn stops accepting connections on SIGTERM and waits for the requests in flight,
which is the drain the runtime needs. Together with prometheus_client they add about 5 MB.
FastAPI would add pydantic and generate a schema from types; the protocols here are fixed by
KServe and OpenAI, so the parsers are written out (each protocol's module in serve/protocols/) and
the OpenAPI document is written by hand (serve/protocols/openapi.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Match, Route

from serve.config import ServeConfig
from serve.errors import HTTPError, too_large
from serve.protocols import kserve, openai, predict, server, tokenize
from serve.protocols.spec import ProtocolSpec, error_body_for
from serve.state import STREAM_FAILED, ServedModel, ServeState, default_model_name  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from serve.llm.events import GenerationQueue
    from serve.llm.model import GenerativeModel
    from serve.state import LoadedModel

log = logging.getLogger("serve")
access_log = logging.getLogger("serve.access")  # one line per request, at debug level (--log-level debug)
OPEN_PATHS = ("/v2/health/", "/metrics")  # open without a key only when the operator says so


def handler_for(engine: dict) -> type[ServedModel] | None:
    """The class that serves this engine block, or None where none does (the load then says so): by
    what the engine's format serves, generation, else an encoder's task, else its tensors. Each class
    declares the protocols it answers (serve.state.ServedModel); the routes ask it. Their modules
    import nothing heavy: the runtime comes in when the model loads."""
    from engines import formats
    from serve.encoder.classifier import ClassifierModel, TextClassifierModel
    from serve.encoder.model import EncoderModel
    from serve.encoder.tensors import TensorModel
    from serve.llm.model import GenerativeModel

    engine_format = formats.FORMATS.get(engine.get("format") or "")
    serves = engine_format.serves if engine_format else None
    if serves == "causal_lm":
        return GenerativeModel  # every engine whose format generates
    if serves != "encoder":
        return None
    by_task: dict[str, type[ServedModel]] = {
        "sentence_embedding": EncoderModel,
        "text_classification": TextClassifierModel,  # logits, named by the artifact's labels.json
        "token_classification": ClassifierModel,
    }
    takes_tensors = engine.get("inputs") and not engine.get("tokenizer")
    # Any other model that takes tensors (images, audio, ...) is a TensorModel.
    return by_task.get(engine.get("task", "")) or (TensorModel if takes_tensors else None)


def load_model_for(state: ServeState):
    """Build the model object the engine block describes (runs in a worker thread)."""
    if state.handler is None:
        raise ValueError(f"this server has no handler for task {state.task!r} on engine {state.engine.get('format')!r}")
    return state.handler.load(state.root, state.engine, state.config)


# --- loading and draining ------------------------------------------------------------------------


async def load_in_background(state: ServeState) -> None:
    """Load while the port already answers: live at once, ready (200) only once this finishes."""
    try:
        model = await asyncio.to_thread(state.load_model, state)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.error("error: could not load the model: %s", state.load_error)
        state.on_fatal(state.load_error)
        return
    start_serving(state, model)


def start_serving(state: ServeState, model: LoadedModel) -> None:
    """The model's queue started (a generation queue, or the batcher of a model that answers batches
    of items), then the model marked ready."""
    from serve.llm.model import GenerativeModel

    if isinstance(model, GenerativeModel):
        state.generator = generation_queue(state, model)
        how = f": {model.describe()}"
    else:
        from serve.encoder.batching import Batcher

        cfg = state.config
        state.batcher = Batcher(
            model.run_batch, cfg.max_batch_size, cfg.max_queue_delay_s, cfg.max_queue, state.metrics, name=state.name
        )
        state.batcher.start()
        how = ""
    log.info("serve: model %r (%s) ready%s", state.name, model.task, how)
    state.model = model
    state.metrics.ready.set(1)


def generation_queue(state: ServeState, model: GenerativeModel) -> GenerationQueue:
    """Continuous batching where the model loaded a batch engine, else one generation at a time."""
    if model.batch_engine is not None:
        from serve.llm.batching import ContinuousBatchingService

        batching = ContinuousBatchingService(
            model, state.config.max_queue, state.metrics, state.manifest, on_broken=state.engine_broken
        )
        engine = batching.engine
        state.metrics.set_cache_info(engine.block_tokens, engine.num_blocks)  # what a gateway's picker reads
        return batching
    from serve.llm.service import GenerationService

    assert model.generator is not None  # a model without a batch engine loaded its Generator
    return GenerationService(model.generator, state.config.max_queue, state.metrics)


async def drain(state: ServeState) -> None:
    """After uvicorn has finished every request in flight: stop the workers, report the count."""
    state.draining = True
    if state.batcher:
        await state.batcher.stop()
    if state.generator:
        await state.generator.stop()
    log.info(
        "serve: stopped; answered %d of %d accepted requests (%d with a server error); "
        "%d closed by their client before the answer; %d cut off by a server error",
        state.ended["answered"],
        state.accepted,
        state.server_errors,
        state.ended["disconnected"],
        state.ended["cut"],
    )


def protocols() -> list[ProtocolSpec]:
    """Every protocol the server speaks, in the order the app routes them (and /openapi.json lists them)."""
    return [kserve.SPEC, openai.SPEC, tokenize.SPEC, predict.SPEC, server.SPEC]


# --- errors as JSON ------------------------------------------------------------------------------


def error_response(path: str, error: HTTPError) -> JSONResponse:
    """The body the protocol that owns `path` answers with (serve/protocols/spec.py)."""
    body = error_body_for(path, protocols())(error)
    return JSONResponse(body, status_code=error.status, headers=error.headers)


async def on_http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return error_response(request.url.path, exc)


async def on_starlette_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
    return error_response(request.url.path, HTTPError(exc.status_code, message, kind, dict(exc.headers or {})))


# --- the gatekeeper: metrics, accounting, auth, size limit -----------------------------------------


class Exchange:
    """One request as the gatekeeper watches it: what was sent, and how it ended."""

    def __init__(self, scope):
        self.scope = scope
        self.started = time.perf_counter()
        self.status = 500
        self.response_started = False
        self.complete = False  # the last byte of the response was handed to the server
        self.error = False  # a server error (an exception, or a stream that ended with an error event)

    def outcome(self) -> tuple[str, int]:
        """(how it ended, the status to count): a stream's 200 went out with its headers, so how the
        stream ended decides what is counted (499 client gone, 500 server error)."""
        if self.complete:
            failed = self.error or self.scope.get(STREAM_FAILED, False)
            return ("answered", 500 if failed else self.status)
        if self.error:
            return ("cut", 500)
        return ("disconnected", 499)


class BodyDeadline:
    """`receive` with a deadline on the whole request body: a client trickling its body gets 408, and
    the request's own --timeout-s (which starts once the body is read) is not its only bound. The
    deadline is lifted once the body is in or the response has begun: Starlette's streaming response
    listens for the client's disconnect with this same `receive`, and a stream must run to its end."""

    def __init__(self, receive, deadline: float):
        self.receive, self.deadline = receive, deadline
        self.lifted = False

    async def __call__(self):
        if self.lifted:
            return await self.receive()
        remaining = self.deadline - time.perf_counter()
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                message = await self.receive()
        except TimeoutError:
            raise HTTPError(
                408, "the request body did not arrive in time", "timeout", {"Connection": "close"}
            ) from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.lifted = True  # the body is complete (or the client is gone)
        return message


class Gatekeeper:
    """Pure ASGI middleware (no extra task per request, and streaming responses pass through).
    Every request is counted once, by how it ended: answered (whatever the status), closed by its
    client (499), or cut off by a server error after its headers went out."""

    def __init__(self, app, state: ServeState, routes: list[Route]):
        self.app, self.state, self.routes = app, state, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, exchange = self.state, Exchange(scope)
        state.accepted += 1
        state.metrics.in_flight.inc()
        deadline = None
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive = deadline = BodyDeadline(receive, exchange.started + state.config.body_timeout_s)

        async def send_and_watch(message):
            if message["type"] == "http.response.start":
                exchange.status, exchange.response_started = message["status"], True
                if deadline is not None:
                    deadline.lifted = True
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                exchange.complete = True

        try:
            refusal = self.refusal(scope)
            app = error_response(scope["path"], refusal) if refusal else self.app
            await app(scope, receive, send_and_watch)
        except ClientDisconnect:
            # The client went away before its answer: nothing is lost and nothing can be sent. Counted
            # as 499 (nginx's "client closed request"), logged without a traceback.
            log.debug("client disconnected on %s", scope["path"])
        except asyncio.CancelledError:
            exchange.error = True  # the server gave up on it (a shutdown past its grace period)
            raise
        except Exception as exc:
            exchange.error = True
            await self.answer_error(scope, receive, send_and_watch, exchange, exc)
        finally:
            self.record(scope, exchange)

    async def answer_error(self, scope, receive, send, exchange: Exchange, exc: Exception) -> None:
        """An unexpected error: 500 with a JSON body if nothing was sent yet; otherwise the response
        stays incomplete and uvicorn closes the connection, the only signal left to the client."""
        log.error("unexpected error on %s", scope["path"], exc_info=exc)
        if exchange.response_started:
            return
        message = f"internal error: {type(exc).__name__}"
        with contextlib.suppress(OSError, ClientDisconnect):
            await error_response(scope["path"], HTTPError(500, message, "server_error"))(scope, receive, send)

    def record(self, scope, exchange: Exchange) -> None:
        """Metrics, the drain counts and the access log line, all from the same outcome."""
        state = self.state
        ended, status = exchange.outcome()
        state.ended[ended] += 1
        if ended == "answered" and status == 500:  # 503 and 504 are answers the server meant to give
            state.server_errors += 1
        # The route Starlette's router chose (it records it in the scope), else match here
        # (requests refused before routing, or Starlette versions that do not record it).
        route = scope.get("route")
        endpoint = route.path if isinstance(route, Route) else self.endpoint(scope)
        elapsed = time.perf_counter() - exchange.started
        state.metrics.in_flight.dec()
        state.metrics.requests.labels(endpoint, scope["method"], str(status)).inc()
        state.metrics.latency.labels(endpoint).observe(elapsed)
        if access_log.isEnabledFor(logging.DEBUG):
            client = (scope.get("client") or ("-",))[0]
            access_log.debug(
                "%s %s %s %d %s %.1f ms", client, scope["method"], scope["path"], status, ended, elapsed * 1e3
            )

    def refusal(self, scope) -> HTTPError | None:
        headers = dict(scope["headers"])
        if not self.authorized(scope["path"], headers):
            return HTTPError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer KEY')",
                "authentication_error",
                {"WWW-Authenticate": "Bearer"},
            )
        declared = headers.get(b"content-length")
        if declared and declared.isdigit() and int(declared) > self.state.config.max_request_bytes:
            return too_large(self.state.config.max_request_bytes)
        return None

    def authorized(self, path: str, headers: dict) -> bool:
        key = self.state.config.api_key
        if not key or (self.state.config.open_health_metrics and path.startswith(OPEN_PATHS)):
            return True
        sent = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = sent.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def endpoint(self, scope) -> str:
        """The route template, so the label set stays bounded whatever paths clients send."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return route.path
        return "unmatched"


# --- the app -------------------------------------------------------------------------------------


def create_app(
    root: str | Path,
    config: ServeConfig | None = None,
    manifest: dict | None = None,
    load_model: Callable = load_model_for,
) -> Starlette:
    from engines.artifact import read_manifest

    root = Path(root)
    manifest = manifest if manifest is not None else read_manifest(root)
    handler = handler_for(manifest.get("engine") or {})
    specs = protocols()
    state = ServeState(root, manifest, config or ServeConfig(), load_model, handler, protocols=specs)
    routes = [route for spec in specs for route in spec.routes()]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loader = asyncio.get_running_loop().create_task(load_in_background(state))
        yield
        loader.cancel()
        await drain(state)

    from starlette.middleware import Middleware

    handlers: dict[Any, Callable[..., Any]] = {
        HTTPError: on_http_error,
        HTTPException: on_starlette_error,
    }
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(Gatekeeper, state=state, routes=routes)],
        exception_handlers=handlers,
    )
    app.state.serve = state
    return app
