"""Command line: verify the artifact, then serve it until SIGTERM (drained) or SIGINT.

Exit codes: 0 after a clean (drained) shutdown, 1 if the model failed to load, 2 for bad input
(missing or tampered artifact, failed gate without the override, bad flags, a host or port it cannot
listen on), always with one line `error: ...` on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from pathlib import Path

from serve.arguments import OneLineParser, count, fail, number, positive, seconds, setting
from serve.config import API_KEY_ENV

MAX_THREADS = 1024  # --threads: a count no CPU here has; past it the runtimes fail inside the model load


def api_key(text: str) -> str:
    """An argparse type: a key a client can send. An empty or blank one would turn auth off (the
    server treats no key as open), and one with surrounding spaces could never match (the server
    strips the token a client sends)."""
    problem = key_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"the key {problem}")
    return text


def key_problem(key: str) -> str | None:
    if not key.strip():
        return "is empty or blank, which would serve without auth (leave it unset for that)"
    if key != key.strip():
        return "starts or ends with whitespace, which no client can send"
    return None


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="python -m serve",
        description="Serve a gated artifact over HTTP (KServe v2 / Triton, OpenAI-compatible, Prometheus metrics).",
    )
    p.add_argument("artifact", help="artifact directory (holds manifest.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=number(int, 0, True, high=65535), default=8000, help="0 picks a free port")
    p.add_argument("--model-name", help="name clients use (default: the recipe's name)")
    p.add_argument(
        "--max-batch-size", type=setting("max_batch_size"), help="rows per model call (default 32 or the recipe's)"
    )
    p.add_argument(
        "--max-queue-delay-ms",
        type=setting("max_queue_delay_ms"),
        help="longest a batch waits to fill (default 5 or the recipe's)",
    )
    p.add_argument("--max-queue", type=setting("max_queue"), help="queued requests before 429 (default 256)")
    p.add_argument(
        "--timeout-s",
        type=setting("timeout_s"),
        help="per-request timeout, queueing included (default 30; 300 for a model that generates)",
    )
    p.add_argument("--max-request-bytes", type=positive(int), help="body size limit, 413 past it (default 4 MiB)")
    p.add_argument("--max-inputs", type=positive(int), help="texts per embeddings request (default 2048)")
    p.add_argument("--max-prompt-tokens", type=positive(int), help="causal LMs: prompt limit (default: context - 1)")
    p.add_argument("--max-tokens", type=positive(int), help="causal LMs: cap on max_tokens (default 512)")
    p.add_argument(
        "--max-num-seqs",
        type=setting("max_num_seqs"),
        help="causal LMs: sequences generated together by an engine that batches continuously "
        "(OpenVINO GenAI; default 16 or the recipe's; 1: one at a time)",
    )
    p.add_argument(
        "--kv-cache-gb",
        type=setting("kv_cache_gb"),
        help="causal LMs, continuous batching: KV cache size in GB (default 1 or the recipe's)",
    )
    p.add_argument(
        "--max-batched-tokens",
        type=setting("max_batched_tokens"),
        help="causal LMs, continuous batching: prompt and decode tokens per scheduling step (default 512)",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="causal LMs, continuous batching: reuse the KV cache of shared prompt prefixes (default on)",
    )
    p.add_argument(
        "--prompt-lookup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="causal LMs, OpenVINO GenAI continuous batching: n-gram speculation from the prompt, no draft "
        "model; pays where answers quote their prompt (default: as the artifact's engine block says)",
    )
    p.add_argument(
        "--header-timeout-s",
        type=positive(float),
        default=10.0,
        help="close a connection whose request headers are not complete within this (default 10)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=positive(float),
        default=30.0,
        help="408 for a request body not received within this (default 30)",
    )
    p.add_argument(
        "--max-connections",
        type=positive(int),
        default=1024,
        help="open connections and requests in progress before new ones get 503 (default 1024)",
    )
    p.add_argument(
        "--threads",
        type=number(int, 0, True, high=MAX_THREADS),
        help="ONNX Runtime threads (default: the CPUs this process may use)",
    )
    p.add_argument(
        "--ort-spinning",
        action="store_true",
        help="let idle ONNX Runtime threads spin (faster on a dedicated machine, slower on a shared one)",
    )
    p.add_argument("--api-key", type=api_key, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    p.add_argument(
        "--open-health-metrics",
        action="store_true",
        help="with an API key, leave /v2/health/* and /metrics open (for probes and scrapers)",
    )
    p.add_argument(
        "--allow-modified",
        action="store_true",
        help="serve even if files differ from the manifest's sha256 (not recommended)",
    )
    p.add_argument("--allow-failed-gate", action="store_true", help="serve an artifact whose gate failed")
    p.add_argument(
        "--key",
        help="file holding the HMAC-SHA256 secret the manifest must be signed with "
        "(default: the file ARTIFACT_VERIFY_KEY names)",
    )
    p.add_argument(
        "--require-signature",
        action="store_true",
        help="refuse an artifact whose manifest is not signed (with --key, by that key)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_shadow_arguments(p)
    return p


# The --shadow-* options: (flag, the attribute argparse gives it, its default). They default to None
# on the command line so that one given without --shadow can be told from one left out.
SHADOW_OPTIONS = (
    ("--shadow-queue", "shadow_queue", 64),
    ("--shadow-threads", "shadow_threads", 1),
    ("--shadow-timeout-s", "shadow_timeout_s", 30.0),
    ("--shadow-report", "shadow_report", "shadow-report"),
)
MAX_SHADOW_QUEUE = 1 << 16  # answered requests held for the candidate (each holds a request and its answer)


def add_shadow_arguments(p: argparse.ArgumentParser) -> None:
    """Shadow traffic (serve/shadow/traffic.py): a candidate answers a copy of every request, off the response path."""
    p.add_argument(
        "--shadow",
        metavar="CANDIDATE",
        help="also send every answered request to CANDIDATE (an artifact folder, served by a child process "
        "on loopback, or an http:// URL) and compare its answers by the gate's measures",
    )
    p.add_argument(
        "--shadow-queue",
        type=count(MAX_SHADOW_QUEUE),
        help="requests waiting for the candidate before new ones are dropped (default 64)",
    )
    p.add_argument(
        "--shadow-threads",
        type=count(MAX_THREADS),
        help="ONNX Runtime threads of the candidate's process (default 1)",
    )
    p.add_argument(
        "--shadow-timeout-s",
        type=seconds(3600),
        help="longest the shadow waits on one candidate answer (default 30)",
    )
    p.add_argument("--shadow-report", help="folder of the shadow's report (default ./shadow-report)")


def check_shadow_options(args) -> None:
    """--shadow-* without --shadow would be ignored: refused instead. With it, the defaults are filled."""
    given = [flag for flag, name, _ in SHADOW_OPTIONS if getattr(args, name) is not None]
    if not args.shadow:
        if given:
            fail(f"{', '.join(given)} set the shadow, which runs only with --shadow CANDIDATE")
        return
    for _, name, default in SHADOW_OPTIONS:
        if getattr(args, name) is None:
            setattr(args, name, default)


def check_key_from_env() -> None:
    """The key from the environment follows the flag's rule: a variable set to blank is refused, not
    read as "no key" (a deployment whose secret did not render would otherwise serve without auth)."""
    import os

    key = os.environ.get(API_KEY_ENV)
    problem = key_problem(key) if key is not None else None
    if problem:
        fail(f"{API_KEY_ENV} {problem}")


def check_artifact(
    root: Path,
    allow_modified: bool,
    allow_failed_gate: bool,
    key_file: str | None = None,
    require_signature: bool = False,
) -> dict:
    """Verify the manifest (its digest, signature and paths) and every file before anything is loaded.
    A refused artifact (malformed or edited manifest, a path leaving it, a link or special file, a bad
    signature) is refused whatever the flags; --allow-modified lifts only changed, missing or extra files."""
    import os

    from engines.artifact import VERIFY_KEY_ENV, ArtifactError, check_signature, read_key, read_manifest, verify

    if not root.is_dir():
        fail(f"{root} is not a directory")
    try:
        key_file = key_file or os.environ.get(VERIFY_KEY_ENV)
        key = read_key(key_file) if key_file else None
        manifest = read_manifest(root)
        signed = check_signature(manifest, key, require_signature)
        problems = verify(root, key, require_signature)
    except ArtifactError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{root}: unreadable manifest or files ({type(exc).__name__}: {exc.strerror or exc})")
    if problems and not allow_modified:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        fail(f"{root} does not match its manifest: {problems[0]}{more}; refusing to serve (--allow-modified overrides)")
    gate = manifest.get("gate") or {}
    if gate.get("passed") is not True and not allow_failed_gate:
        failed = [
            c.get("name") if isinstance(c, dict) else c
            for c in gate.get("checks", [])
            if not (isinstance(c, dict) and c.get("passed"))
        ]
        fail(
            f"{root}: the gate did not pass (failed checks: {', '.join(map(str, failed)) or 'none recorded'}); "
            f"refusing to serve (--allow-failed-gate overrides)"
        )
    log = logging.getLogger("serve")
    for problem in problems:
        log.warning("serving a modified artifact: %s", problem)
    log.info("serve: manifest %s", signed)
    return manifest


def check_engine_installed(manifest: dict) -> None:
    """An artifact whose engine this environment cannot run (a package its format needs is not
    installed, no C compiler for the native kernels) is one line naming the format and what is
    missing, exit 2, before the port opens: the load would find it only later, in a worker thread."""
    from engines import formats

    engine = manifest.get("engine")
    engine_format = formats.FORMATS.get(str(engine.get("format"))) if isinstance(engine, dict) else None
    reason = engine_format.serving_unavailable() if engine_format else None
    if reason:
        fail(reason)


def check_listen_address(host: str, port: int) -> None:
    """A host this machine cannot listen on, or a port another process holds, is one line and exit 2
    before the model loads: uvicorn finds either only after the load, and says it in its own log lines.
    The probe binds as uvicorn does (address reuse on; an empty host: every interface), then lets go
    of the port for uvicorn to take."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        fail(f"--host {host[:100]}: not an address this machine can listen on ({exc})")
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


def check_candidate(args) -> dict:
    """The shadow's candidate, checked before the model loads: a URL (http://, a valid host and port,
    not this server itself: its copies would come back to it), or an artifact folder verified as the
    served one is, without --allow-modified; and a report folder it can write. Returns the candidate's
    manifest ({} for a URL)."""
    from serve.arguments import url_problem
    from serve.shadow.candidate import self_problem
    from serve.shadow.report import folder_problem

    problem = folder_problem(Path(args.shadow_report))
    if problem:
        fail(f"--shadow-report {problem}")
    if "://" not in args.shadow:
        return check_artifact(Path(args.shadow), False, args.allow_failed_gate, args.key, args.require_signature)
    problem = url_problem(args.shadow, ("http",))
    if problem:
        fail(f"--shadow {problem} (give an http:// URL of a candidate on the local network, or an artifact folder)")
    problem = self_problem(args.shadow, args.host, args.port)
    if problem:
        fail(f"--shadow {problem}")
    return {}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_shadow_options(args)
    if args.api_key is None:
        check_key_from_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_listen_address(args.host, args.port)
    candidate_manifest = check_candidate(args) if args.shadow else None
    root = Path(args.artifact)
    manifest = check_artifact(root, args.allow_modified, args.allow_failed_gate, args.key, args.require_signature)
    check_engine_installed(manifest)

    from serve.app import create_app
    from serve.config import resolve

    config = resolve(vars(args), manifest)
    app = create_app(root, config, manifest)
    shadow = None
    if candidate_manifest is not None:
        from serve.shadow.candidate import ShadowRun

        shadow = ShadowRun(app, args, manifest, candidate_manifest)
    try:
        return run_server(app, args.host, args.port, config, args.log_level)
    finally:
        if shadow is not None:
            shadow.close()


def run_server(app, host: str, port: int, config, log_level: str) -> int:
    import uvicorn

    state = app.state.serve
    exit_code = [0]
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=int(config.timeout_s) + 5,
            timeout_keep_alive=5,
            lifespan="on",
            limit_concurrency=config.max_connections,
            http=header_timeout_protocol(config.header_timeout_s),
        ),
        state,
    )

    def fatal(message: str) -> None:
        exit_code[0] = 1
        server.should_exit = True

    state.on_fatal = fatal
    server.run()
    return exit_code[0]


def header_timeout_protocol(timeout_s: float):
    """uvicorn's HTTP protocol (httptools, else h11) with a deadline on request headers: uvicorn has none,
    and its keep-alive timer stops at the first byte, so a client trickling a header a byte at a time
    would hold its connection forever. The deadline starts when the connection opens and again when a
    new request begins; the connection is closed if the headers are not complete by then."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:  # pragma: no cover - httptools is in the serve extra
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base  # type: ignore[assignment]

    class HeaderTimeoutProtocol(Base):  # type: ignore[valid-type, misc]
        header_timer = None

        def arm(self) -> None:
            if self.header_timer is None:
                self.header_timer = self.loop.call_later(timeout_s, self.headers_too_slow)

        def disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if self.transport is not None and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.arm()

        def on_headers_complete(self) -> None:
            self.disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self.disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, but a SIGTERM marks the app as draining and the exit code stays 0."""

        def __init__(self, config, state):
            super().__init__(config)
            self.serve_state = state

        def handle_exit(self, sig, frame):
            self.serve_state.draining = True  # /v2/health/ready answers 503 from now on
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal after shutting down, which turns a clean drain into a
            # death by SIGTERM (exit 143); keep its handlers, drop the re-raise.
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return DrainingServer


def DrainingServer(config, state):  # noqa: N802 (a factory: uvicorn is imported only when serving)
    return draining_server_class()(config, state)


if __name__ == "__main__":
    sys.exit(main())
