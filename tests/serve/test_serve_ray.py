"""`python -m serve.ray ARTIFACT --replicas 2` on a local Ray instance on loopback, with the real
encoder artifact: requests spread over both replicas, a replica killed under load is replaced and no
request is lost (answered, or retried by its client to an answer), SIGTERM drains what is in flight
and exits 0. Bad configuration is refused with one line before Ray starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve.shadow.candidate import free_port
from tests.support.cli import one_error_line
from tests.support.serve import ROOT, wait_until

TEXTS = ["a first sentence", "the second one, longer than the first"]


def refused(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serve.ray", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_zero_replicas_and_lopsided_autoscaling_are_refused():
    one_error_line(refused("/no/matter", "--replicas", "0"), "--replicas", "must be >= 1")
    one_error_line(refused("/no/matter", "--min-replicas", "1"), "--min-replicas and --max-replicas go together")
    one_error_line(refused("/no/matter", "--shadow", "/tmp"), "--shadow is served by python -m serve")
    one_error_line(
        refused("/no/matter", "--replicas", "5", "--min-replicas", "1", "--max-replicas", "2"), "outside --min-replicas"
    )


@pytest.mark.slow
def test_a_missing_or_tampered_artifact_is_refused(encoder_artifact, tmp_path):
    one_error_line(refused(str(tmp_path / "missing"), "--replicas", "2"), "is not a directory")
    copy = tmp_path / "artifact"
    shutil.copytree(encoder_artifact, copy)
    with open(copy / "tokenizer" / "tokenizer.json", "a") as f:
        f.write(" ")
    one_error_line(refused(str(copy), "--replicas", "2"), "does not match its manifest", log_lines=True)


class RayServer:
    def __init__(self, artifact, *args: str):
        self.port = free_port()
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve.ray", str(artifact), "--port", str(self.port), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(
            target=lambda: self.lines.extend(line.rstrip() for line in self.proc.stdout), daemon=True
        ).start()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def wait_ready(self) -> None:
        def up():
            assert self.proc.poll() is None, self.output
            return any("serve.ray: " in line for line in self.lines)

        wait_until(up, timeout=240, step=0.5)


def embed(url: str, name: str, retries: int = 0) -> tuple[int, str | None, int]:
    """(status, the replica that answered, tries): a client that retries a 5xx or a dropped
    connection (the request is idempotent) up to `retries` times."""
    for attempt in range(retries + 1):
        try:
            response = httpx.post(url + "/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=120)
        except httpx.TransportError:
            continue
        if response.status_code < 500 or attempt == retries:
            return response.status_code, response.headers.get("x-serve-replica"), attempt + 1
        time.sleep(0.2)
    return 0, None, retries + 1


@pytest.mark.slow
def test_two_replicas_share_the_load_survive_a_lost_one_and_drain(encoder_artifact, encoder_name):
    server = RayServer(encoder_artifact, "--replicas", "2", "--threads", "1", "--cpus-per-replica", "0.5")
    try:
        server.wait_ready()
        with ThreadPoolExecutor(8) as pool:
            first = list(pool.map(lambda _: embed(server.url, encoder_name), range(40)))
        assert {status for status, _, _ in first} == {200}, server.output
        replicas = {replica for _, replica, _ in first}
        assert len(replicas) == 2, replicas  # the router used both

        # Kill one replica's process while 8 clients keep sending; every request ends answered.
        victim = int(sorted(replicas)[0])
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(embed, server.url, encoder_name, 5) for _ in range(80)]
            time.sleep(0.5)
            os.kill(victim, signal.SIGKILL)
            under_loss = [f.result() for f in futures]
        assert {status for status, _, _ in under_loss} == {200}, (under_loss, server.output)

        # Ray starts a replacement: two replicas answer again, the dead one not among them.
        def replaced():
            seen = {embed(server.url, encoder_name, 5)[1] for _ in range(16)}
            return len(seen - {str(victim)}) == 2

        wait_until(replaced, timeout=180, step=1)

        # SIGTERM with requests in flight: each one accepted is answered, then the driver exits 0.
        big = {"model": encoder_name, "input": [f"sentence number {i} of a long request" for i in range(256)]}
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(httpx.post, server.url + "/v1/embeddings", json=big, timeout=120) for _ in range(4)]
            time.sleep(1.0)
            server.proc.send_signal(signal.SIGTERM)
            statuses = [f.result().status_code for f in futures]
        assert statuses == [200] * 4, server.output
        assert server.proc.wait(120) == 0, server.output
        assert "serve.ray: stopped" in server.output
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_autoscaling_settings_are_ray_serves_own():
    """The options serve.ray deploys with parse as Ray Serve's AutoscalingConfig, target and caps as given."""
    import ray.serve.config as config_module

    from serve.config import ServeConfig
    from serve.ray import build_parser, deployment_options

    args = build_parser().parse_args(["x", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "6"])
    options = deployment_options(args, ServeConfig(max_batch_size=16, timeout_s=20))
    scaling = config_module.AutoscalingConfig(**options["autoscaling_config"])
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 2, 6)
    assert scaling.target_ongoing_requests == 16 and options["max_ongoing_requests"] == 64
    assert options["graceful_shutdown_timeout_s"] == 25 and "num_replicas" not in options
    fixed = deployment_options(build_parser().parse_args(["x", "--replicas", "3"]), ServeConfig())
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed


def test_ingress_and_throughput_switches_are_ray_serves_own(monkeypatch):
    """HAProxy and the throughput mode by default, as environment variables Ray Serve itself reads."""
    import inspect

    import ray.serve._private.constants as constants

    from serve.config import ServeConfig
    from serve.ray import build_parser, deployment_options, ray_environment

    default = build_parser().parse_args(["x"])
    chosen = ray_environment(default)
    assert chosen["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and chosen["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert chosen["RAY_SERVE_HAPROXY_METRICS_ENABLED"] == "0"
    assert 1 <= int(chosen["RAY_SERVE_HAPROXY_NBTHREAD"]) <= min(4, os.cpu_count() or 1)
    source = inspect.getsource(constants)
    assert all(f'"{name}"' in source for name in chosen)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_NBTHREAD", "3")  # the user's own setting wins
    assert ray_environment(default)["RAY_SERVE_HAPROXY_NBTHREAD"] == "3"
    plain = build_parser().parse_args(["x", "--ingress", "proxy", "--no-throughput-optimized"])
    assert ray_environment(plain) == {}
    quiet = build_parser().parse_args(["x", "--log-level", "warning"])
    assert deployment_options(quiet, ServeConfig())["logging_config"] == {"enable_access_log": False}
    assert deployment_options(default, ServeConfig())["logging_config"] == {"enable_access_log": True}


@pytest.mark.parametrize(
    ("address", "fragment"),
    [
        ("ray://256.1.1.1:99999", "Port out of range"),
        ("ray://256.1.1.1:10001", "'256.1.1.1' is not a valid IPv4 address"),
        ("ray://[::1", "Invalid IPv6 URL"),
        ("10.0.0.1", "a cluster's address takes its port (HOST:PORT)"),
        ("bad..host:6379", "'bad..host' is not a host name or an IP address"),
        ("10.0.0.1:0", "the port must be from 1 to 65535"),
        ("http://10.0.0.1:6379", "the URL must start with ray://"),
    ],
)
def test_a_ray_address_that_cannot_be_a_cluster_is_one_line(address, fragment, capsys):
    from serve.ray import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["/no/matter", "--address", address])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --address: ") and err.count("\n") == 1 and fragment in err, err


def test_good_ray_addresses_and_the_connect_timeout_parse():
    from serve.ray import build_parser

    for address in ("auto", "local", "ray://10.0.0.1", "ray://head.example:10001", "10.0.0.1:6379", "[::1]:6379"):
        assert build_parser().parse_args(["a", "--address", address]).address == address
    assert build_parser().parse_args(["a"]).connect_timeout_s == 120.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["a", "--connect-timeout-s", "inf"])


def test_shadow_options_are_refused_on_ray_too(capsys):
    from serve.ray import build_parser, check_scaling

    with pytest.raises(SystemExit):
        check_scaling(build_parser().parse_args(["a", "--shadow-queue", "4"]))
    assert "--shadow is served by python -m serve" in capsys.readouterr().err


@pytest.mark.slow
def test_a_cluster_that_never_answers_is_one_line_within_the_connect_timeout(encoder_artifact):
    started = time.monotonic()
    proc = refused(str(encoder_artifact), "--address", "192.0.2.1:6379", "--connect-timeout-s", "5")
    one_error_line(proc, "cannot connect to Ray at 192.0.2.1:6379", log_lines=True)
    assert time.monotonic() - started < 90
