"""The state every route shares, and how a route finds it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Protocol, Sequence, TypeVar, Union

from starlette.requests import Request

from serve.config import ServeConfig
from serve.errors import bad_request, unavailable

if TYPE_CHECKING:
    from serve.encoder.batching import Batcher, BatchModel
    from serve.llm.events import GenerationQueue
    from serve.llm.model import GenerativeModel
    from serve.protocols.spec import ProtocolSpec

    # What a handler class loads: a model that answers batches of items, or one that generates.
    LoadedModel = Union[BatchModel, GenerativeModel]

Model = TypeVar("Model")

# Scope key a streaming route sets when its stream ended with an error event: the 200 went out with
# the headers, and the request is counted as the server error it was.
STREAM_FAILED = "serve.stream_failed"


class ServedModel(Protocol):
    """What a handler class (serve.encoder.model, serve.encoder.classifier, serve.encoder.tensors,
    serve.llm.model) says about itself. The routes ask it, not the task's name, so a new handler needs
    no change to them."""

    ANSWERS: ClassVar[frozenset[str]]  # the protocols it answers: "tensors", "embeddings", "predict", "completions"
    # What it is and where it is served, for a refusal; "{name}" and "{task}" are the served model's.
    USE: ClassVar[str]

    @classmethod
    def load(cls, root: Path, engine: dict, config: ServeConfig) -> LoadedModel:
        """The model as this server runs it (in a worker thread)."""
        ...


class ServeState:
    """Everything the routes share: the manifest, settings, metrics, and the model once loaded."""

    def __init__(
        self,
        root: Path,
        manifest: dict,
        config: ServeConfig,
        load_model: Callable,
        handler: type[ServedModel] | None,  # the class that serves the engine block; None: nothing does
        protocols: Sequence[ProtocolSpec] = (),  # what the app speaks (serve.app.protocols()), for /openapi.json
    ):
        from serve.metrics import Metrics

        self.root, self.manifest, self.config = root, manifest, config
        self.engine = manifest.get("engine") or {}
        self.handler = handler
        self.protocols = list(protocols)
        self.name = config.model_name or default_model_name(root, manifest)
        self.version = "1"
        self.load_model = load_model
        self.metrics = Metrics()
        self.model: LoadedModel | None = None  # an instance of the handler class, once loaded
        self.batcher: Batcher | None = None  # models that answer batches of items
        self.generator: GenerationQueue | None = None  # causal LMs: serve.llm.service or serve.llm.batching
        self.load_error: str | None = None
        # Why the engine was given up after failing (serve/llm/batching.py): not ready, not live.
        self.broken: str | None = None
        self.on_fatal: Callable[[str], None] = lambda message: None
        self.draining = False
        # Requests by how they ended: answered (whatever the status), disconnected (the client left
        # before its answer, counted as 499), cut (a server error after the headers went out).
        self.accepted = 0
        self.ended = {"answered": 0, "disconnected": 0, "cut": 0}
        self.server_errors = 0  # answered with a 500, or a stream that ended with an error event
        self.created = int(time.time())

    @property
    def task(self) -> str:
        return self.engine.get("task", "unknown")

    @property
    def ready(self) -> bool:
        return self.model is not None and not self.draining and not self.broken

    def engine_broken(self, reason: str) -> None:
        """The engine failed and could not be restarted: health answers 503 naming why, and the
        process is asked to exit non-zero (on_fatal) so that its orchestrator replaces it."""
        self.broken = reason
        self.metrics.ready.set(0)
        self.on_fatal(f"the engine is broken: {reason}")

    def health_problem(self, readiness: bool) -> str | None:
        """Why /v2/health/ready (readiness) or /live answers 503; None: 200."""
        if self.broken:
            return f"the engine failed and could not be restarted: {self.broken}"
        if not readiness or self.ready:
            return None
        if self.load_error:
            return f"the model failed to load: {self.load_error}"
        return "the server is draining" if self.draining else "the model is loading"

    def require_ready(self) -> None:
        if self.load_error:
            raise unavailable(f"the model failed to load: {self.load_error}", retry_after_s=60)
        if self.broken:
            raise unavailable(f"the engine failed and could not be restarted: {self.broken}", retry_after_s=60)
        if self.model is None:
            raise unavailable("the model is loading")
        # Draining is not refused here: a request uvicorn still accepts is served to the end.

    def ready_model(self, kind: type[Model]) -> Model:
        """The loaded model, as the route needs it: require_ready()'s refusals first. The route asked
        require_answers() before, so the handler class is one that answers it; a model of another
        kind here is a bug in the server (a 500)."""
        self.require_ready()
        if not isinstance(self.model, kind):
            raise TypeError(f"the served model is a {type(self.model).__name__}, not a {kind.__name__}")
        return self.model

    def batch_model(self) -> BatchModel:
        """The loaded model that answers batches of items (an encoder, a classifier, a tensor model)."""
        from serve.llm.model import GenerativeModel

        self.require_ready()
        if self.model is None or isinstance(self.model, GenerativeModel):
            raise TypeError(f"the served model is a {type(self.model).__name__}, which answers no tensors")
        return self.model

    def ready_batcher(self) -> Batcher:
        """The batcher in front of a loaded model that answers batches (the route asked for the model first)."""
        if self.batcher is None:
            raise unavailable("the model is loading")
        return self.batcher

    def generation_queue(self) -> GenerationQueue:
        """The generation queue of a loaded causal LM (the route asked for the model first)."""
        if self.generator is None:
            raise unavailable("the model is loading")
        return self.generator

    def require_answers(self, protocol: str, param: str | None = None) -> None:
        """400 where the handler class does not answer `protocol`, saying where the model is served.
        Known from the manifest, so a request on the wrong route is refused while the model loads too."""
        if self.handler is None or protocol in self.handler.ANSWERS:
            return  # without a handler the load fails, and require_ready says why
        use = self.handler.USE.format(name=self.name, task=self.task)
        raise bad_request(f"model {self.name!r} is {use}", param=param)


def default_model_name(root: Path, manifest: dict) -> str:
    """The recipe's name (what an operator chose), else the artifact folder's name."""
    name = ((manifest.get("recipe") or {}).get("name")) or root.resolve().name
    return str(name).replace("/", "_")


def state_of(request: Request) -> ServeState:
    return request.app.state.serve
