"""`python -m serve.ray ARTIFACT --replicas N`: the same server as replicas of a Ray Serve deployment.

Each replica runs this server's ASGI app (serve/app.py) unchanged, behind Ray Serve's HAProxy
ingress (or its Python proxy, --ingress proxy): the same routes, limits, metrics and drain. The
artifact is verified twice: in the driver before anything is deployed (one line, exit 2, as `python
-m serve`), and in each replica before it loads (a node that reads a different file refuses it). A
replica loads its model in its constructor, so Ray routes nothing to it before it can answer.
HAProxy sends each request to the replica with the fewest connections (the Python proxy: power of
two choices on requests in flight); the autoscaler scales on ongoing requests per replica. Every
answer carries `x-serve-replica` (the replica's process id). SIGTERM or SIGINT drains: the
deployment is deleted gracefully (each replica finishes what it holds, up to --timeout-s + 5 s),
then Ray stops; exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

from serve.__main__ import SHADOW_OPTIONS, check_artifact, check_key_from_env
from serve.__main__ import build_parser as serve_parser
from serve.arguments import fail, number, one_line, positive, seconds, url_problem

log = logging.getLogger("serve.ray")
APP_NAME = "serve"
# check_artifact's arguments, by the flag that sets each.
CHECKS = {"allow_modified": "allow_modified", "allow_failed_gate": "allow_failed_gate", "key": "key_file"}
CHECKS["require_signature"] = "require_signature"
# Ray Serve's own switches, read from the environment when its processes import it, so they are set
# before Ray starts. The Python proxy costs a few ms of CPU per request in the proxy and the replica
# (on a 2-core machine, 2 replicas of a small encoder behind it answered 0.2-0.3x one process's
# requests/s); HAProxy forwards to each replica's own HTTP server, and the throughput mode runs the
# app on the replica's event loop instead of a second one with a hop per ASGI message.
# HAProxy's threads: at most the driver node's cores (Ray's default of 4 on 2 cores took CPU from the
# replicas), and Ray's per-request ingress metrics off: the app's own serve_* metrics count every
# request already, and Ray's cost a log line per request through its HAProxy manager. Together
# 0.88x -> 0.94x one process on the 2-core machine of docs/deploy.md.
INGRESS = {
    "proxy": {},
    "haproxy": {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_NBTHREAD": str(min(4, os.cpu_count() or 1)),
        "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
    },
}
THROUGHPUT_OPTIMIZED = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}


def build_parser():
    p = serve_parser()
    p.prog = "python -m serve.ray"
    p.description = "Serve a gated artifact as replicas of a Ray Serve deployment (the same app as python -m serve)."
    p.add_argument(
        "--replicas", type=number(int, 1, True, high=4096), default=1, help="replicas (initial ones with autoscaling)"
    )
    p.add_argument(
        "--min-replicas", type=number(int, 1, True, high=4096), help="autoscale on ongoing requests, down to this"
    )
    p.add_argument("--max-replicas", type=number(int, 1, True, high=4096), help="autoscale up to this")
    p.add_argument(
        "--target-ongoing-requests",
        type=positive(float),
        help="autoscaling target: requests in flight per replica (default: the batch size)",
    )
    p.add_argument(
        "--max-ongoing-requests",
        type=positive(int),
        help="a replica's cap on requests in flight; Ray queues the rest (default 4x the target)",
    )
    p.add_argument(
        "--cpus-per-replica", type=positive(float), default=1.0, help="Ray CPUs each replica reserves (default 1)"
    )
    p.add_argument(
        "--ingress",
        choices=sorted(INGRESS),
        default="haproxy",
        help="proxy: Ray Serve's Python HTTP proxy; haproxy: HAProxy straight to the replicas' own HTTP servers",
    )
    p.add_argument(
        "--throughput-optimized",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Ray Serve's throughput mode: the app on the replica's own event loop, request logs buffered",
    )
    p.add_argument(
        "--address",
        type=ray_address,
        default=os.environ.get("RAY_ADDRESS") or None,
        help="Ray cluster to join: auto, HOST:PORT or ray://HOST[:PORT] (default: RAY_ADDRESS, else a local instance)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=seconds(3600),
        default=120.0,
        help="longest to wait for Ray to start or for the cluster to answer before giving up (default 120)",
    )
    return p


def ray_address(text: str) -> str:
    """An argparse type: what ray.init's address takes here: auto (the cluster this node is part of),
    local, HOST:PORT (a cluster's GCS) or ray://HOST[:PORT] (Ray Client); a host that is a valid name
    or address and a port from 1 to 65535. RAY_ADDRESS is checked by the same rule."""
    if text in ("auto", "local"):
        return text
    client = "://" in text  # any other scheme is refused by url_problem
    problem = url_problem(text if client else f"ray://{text}", ("ray",))
    if problem is None and not client and urlsplit(f"ray://{text}").port is None:
        problem = "a cluster's address takes its port (HOST:PORT)"
    if problem:
        problem = problem if client else problem.replace(f"ray://{text}", text)
        raise argparse.ArgumentTypeError(f"{problem}; give auto, HOST:PORT or ray://HOST[:PORT]")
    return text


def check_scaling(args) -> None:
    if args.shadow or any(getattr(args, name) is not None for _, name, _ in SHADOW_OPTIONS):
        fail("--shadow is served by python -m serve (one process); shadow a Ray deployment from a gateway instead")
    low, high = args.min_replicas, args.max_replicas
    if (low is None) != (high is None):
        fail("--min-replicas and --max-replicas go together (autoscaling); give both, or --replicas alone")
    if low is not None and not low <= args.replicas <= high:
        fail(f"--replicas {args.replicas} is outside --min-replicas {low} .. --max-replicas {high}")


def ray_environment(args) -> dict:
    """The Ray Serve switches the flags choose (a cluster joined with --address must run with the same);
    one already set in the environment is kept as it is."""
    chosen = {**INGRESS[args.ingress], **(THROUGHPUT_OPTIMIZED if args.throughput_optimized else {})}
    return {name: os.environ.get(name, value) for name, value in chosen.items()}


def deployment_options(args, config) -> dict:
    """Ray Serve's settings for the deployment: replicas or autoscaling, the in-flight caps, the drain."""
    target = args.target_ongoing_requests or config.max_batch_size
    options: dict = {
        "name": APP_NAME,
        "max_ongoing_requests": args.max_ongoing_requests or max(1, int(4 * target)),
        "ray_actor_options": {"num_cpus": args.cpus_per_replica},
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": config.timeout_s + 5,  # what uvicorn gives `python -m serve`
        "health_check_period_s": 5.0,
        # One access-log line per request costs the replica more than a small model's answer; it follows
        # --log-level as `python -m serve`'s does.
        "logging_config": {"enable_access_log": args.log_level in ("debug", "info")},
    }
    if args.min_replicas is None:
        options["num_replicas"] = args.replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": args.min_replicas,
            "max_replicas": args.max_replicas,
            "initial_replicas": args.replicas,
            "target_ongoing_requests": target,
        }
    return options


# --- in a replica ------------------------------------------------------------------------------------


class ReplicaHeader:
    """ASGI middleware: `x-serve-replica: PID` on every answer, so clients and tests see the spread."""

    def __init__(self, app):
        self.app, self.pid = app, str(os.getpid()).encode()

    async def __call__(self, scope, receive, send):
        async def send_with_replica(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-serve-replica", self.pid)]}
            await send(message)

        await self.app(scope, receive, send_with_replica if scope["type"] == "http" else send)


def replica_app(root: str, checks: dict, config):
    """The app of one replica, its model loaded (this runs in the replica's constructor)."""
    from serve.app import create_app, load_model_for

    try:
        manifest = check_artifact(Path(root), **checks)
    except SystemExit:  # check_artifact printed the one line; a replica raises instead of exiting
        raise RuntimeError(f"{root}: the artifact was refused on this node (see the line above)") from None
    app = create_app(root, config, manifest)
    state = app.state.serve
    model = load_model_for(state)
    state.load_model = lambda _state: model  # the lifespan's load finds it done
    app.add_middleware(ReplicaHeader)
    return app


def deployment_class():
    """The Ray Serve deployment class (built here: Ray is imported only when serving on it)."""
    import asyncio

    from ray import serve as ray_serve

    @ray_serve.ingress()
    class ServeReplica:
        async def __init__(self, root: str, checks: dict, config):  # type: ignore[misc]  # Ray awaits it
            self.served = await asyncio.to_thread(replica_app, root, checks, config)

        def __serve_build_asgi_app__(self):
            return self.served

        def check_health(self) -> None:
            state = self.served.state.serve
            if state.load_error:
                raise RuntimeError(state.load_error)

    return ServeReplica


# --- the driver --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_scaling(args)
    if args.api_key is None:
        check_key_from_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = Path(args.artifact).resolve()
    checks = {argument: getattr(args, flag) for flag, argument in CHECKS.items()}
    manifest = check_artifact(root, **checks)

    from serve.config import resolve

    config = resolve(vars(args), manifest)
    config.threads = config.threads or max(1, int(args.cpus_per_replica))
    ray_env = ray_environment(args)
    os.environ.update(ray_env)  # before Ray's modules read them, in this process and the ones it starts
    try:
        import ray
        from ray import serve as ray_serve
    except ImportError:
        fail("Ray Serve is not installed (pip install 'ray[serve]', the fleet extra)")
    init = dict(
        address=args.address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        runtime_env={"env_vars": ray_env} if ray_env else None,
    )
    if args.address in (None, "local"):  # a local instance starts in this (main) thread: Ray needs it there
        ray.init(**init)
    else:
        within_deadline(lambda: ray.init(**init), args.connect_timeout_s, f"Ray at {args.address}")
    ray_serve.start(http_options={"host": args.host, "port": args.port})
    options = deployment_options(args, config)
    app = ray_serve.deployment(**options)(deployment_class()).bind(str(root), checks, config)
    name = config.model_name or (manifest.get("recipe") or {}).get("name") or root.name
    ray_serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    scale = options.get("num_replicas") or f"{args.min_replicas}..{args.max_replicas}"
    print(f"serve.ray: {scale} replicas of {name!r} on http://{args.host}:{args.port}", flush=True)
    wait_for_signal()
    log.info("serve.ray: draining")
    ray_serve.delete(APP_NAME)  # waits for each replica's graceful shutdown
    ray_serve.shutdown()
    ray.shutdown()
    print("serve.ray: stopped", flush=True)
    return 0


def within_deadline(connect, timeout_s: float, what: str) -> None:
    """Run `connect` (ray.init) with a deadline: Ray has no timeout of its own for reaching a cluster
    (an address no cluster answers at is retried for minutes, or forever). Past the deadline, or on
    an error, one line and exit 2; the process exits at once, as the connecting thread cannot be
    stopped."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            connect()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 (reported as the one line)
            outcome.append(exc)

    thread = threading.Thread(target=run, name="ray-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if outcome and outcome[0] is None:
        return
    reason = f"{type(outcome[0]).__name__}: {outcome[0]}" if outcome else f"no answer within {timeout_s:g} s"
    print(f"error: cannot connect to {one_line(what)}: {one_line(reason)[:300]}", file=sys.stderr, flush=True)
    os._exit(2)


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1):
        pass


if __name__ == "__main__":
    sys.exit(main())
