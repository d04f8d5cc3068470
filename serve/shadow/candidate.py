"""`python -m serve ARTIFACT --shadow CANDIDATE`: the candidate verified, served by a child process
on loopback (or reached at a URL), and the shadow attached to the app (serve/shadow/traffic.py)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

log = logging.getLogger("serve.shadow")
REPORT_EVERY_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def self_problem(candidate_url: str, host: str, port: int) -> str | None:
    """Why the candidate at `candidate_url` would be this server itself (listening on `host`:`port`),
    or None. Its copies of requests would come back to it: the mark on them (serve/shadow/traffic.py) keeps
    each from being copied again, but a server comparing itself with itself measures nothing. Names
    are compared by the addresses they resolve to; every loopback address counts as one, and a
    server listening on every interface (0.0.0.0, ::) is every address this machine holds."""
    parts = urlsplit(candidate_url)
    candidate_port = parts.port or 80
    if port == 0 or candidate_port != port:  # port 0: the server's port is a free one, unknown yet
        return None
    try:
        candidates = resolved(parts.hostname or "", candidate_port)
    except OSError as exc:
        return f"{candidate_url[:100]}: cannot resolve {parts.hostname!r} ({exc.strerror or exc})"
    own = resolved(host or None, port, passive=True)
    if any(same_listener(address, listening) for address in candidates for listening in own):
        return f"{candidate_url[:100]} is this server itself ({host or '*'}:{port}); shadow a different server"
    return None


def resolved(host: str | None, port: int, passive: bool = False) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    flags = socket.AI_PASSIVE if passive else 0
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    return {ipaddress.ip_address(str(address[4][0]).split("%")[0]) for address in found}


def same_listener(address, listening) -> bool:
    """Whether a connection to `address` reaches a socket listening on `listening` (same port)."""
    if listening.is_unspecified:
        return address.is_unspecified or address.is_loopback or is_local(address)
    if address.is_loopback and listening.is_loopback:
        return True
    return address == listening or (address.is_unspecified and (listening.is_loopback or is_local(listening)))


def is_local(address) -> bool:
    """Whether this machine holds `address` (it can bind a socket to it)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((str(address), 0))
        except OSError:
            return False
    return True


def lower_priority() -> None:
    """In the child before exec: below the server's CPU priority, and gone when the server dies."""
    os.nice(10)
    with contextlib.suppress(Exception):  # Linux: PR_SET_PDEATHSIG, SIGTERM when the parent dies
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class Candidate:
    """Where the shadow sends requests: a child `python -m serve` for a folder, or a given URL."""

    def __init__(self, source: str, args, model_name: str, manifest: dict):
        self.proc: subprocess.Popen | None = None
        self.manifest = manifest  # verified by the command line (serve.__main__.check_candidate)
        if source.startswith("http://"):
            self.url = source.rstrip("/")
            return
        root = Path(source)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "serve", str(root), "--host", "127.0.0.1", "--port", str(port)]
        # Its warnings and errors only: its startup lines would read as the server's own.
        quiet = "error" if args.log_level == "error" else "warning"
        command += ["--model-name", model_name, "--threads", str(args.shadow_threads), "--log-level", quiet]
        command += ["--max-queue", str(args.shadow_queue * 2)]
        for flag, value in (("--key", args.key), ("--timeout-s", args.timeout_s)):
            if value is not None:
                command += [flag, str(value)]
        command += ["--require-signature"] if args.require_signature else []
        command += ["--allow-failed-gate"] if args.allow_failed_gate else []
        self.proc = subprocess.Popen(command, preexec_fn=lower_priority)
        log.info("serve: shadow candidate %s (pid %d) at %s", root, self.proc.pid, self.url)

    def wait_ready(self, ready: threading.Event, stop: threading.Event) -> None:
        """Poll the candidate's readiness until it answers 200 (the shadow sends nothing before)."""
        while not stop.is_set():
            if self.proc is not None and self.proc.poll() is not None:
                log.warning("serve: the shadow candidate exited with %s; nothing is shadowed", self.proc.returncode)
                return
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/v2/health/ready", timeout=2) as response:
                    if response.status == 200:
                        ready.set()
                        log.info("serve: shadow candidate ready at %s", self.url)
                        return
            stop.wait(0.2)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)  # a stopped child would never see the SIGTERM
            self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ShadowRun:
    """The candidate, the shadow, the report writer: started before serving, closed after."""

    def __init__(self, app, args, manifest: dict, candidate_manifest: dict):
        from serve.llm.model import GenerativeModel
        from serve.shadow.traffic import GENERATES, Shadow, ShadowTap

        state = app.state.serve
        self.artifact_manifest, self.report_dir = manifest, Path(args.shadow_report)
        self.candidate = Candidate(args.shadow, args, state.name, candidate_manifest)
        task = GENERATES if state.handler is GenerativeModel else state.task
        self.shadow = Shadow(self.candidate.url, task, state.metrics, args.shadow_queue, args.shadow_timeout_s)
        app.add_middleware(ShadowTap, shadow=self.shadow)
        self.stopping = threading.Event()
        threading.Thread(target=self.candidate.wait_ready, args=(self.shadow.ready, self.stopping), daemon=True).start()
        threading.Thread(target=self.report_now_and_then, daemon=True).start()

    def report_now_and_then(self) -> None:
        while not self.stopping.wait(REPORT_EVERY_S):
            self.write()

    def write(self) -> None:
        from serve.shadow.report import write_report

        try:
            write_report(self.report_dir, self.shadow.summary(), self.artifact_manifest, self.candidate.manifest)
        except OSError as exc:
            log.warning("serve: could not write the shadow report to %s: %s", self.report_dir, exc)

    def close(self) -> None:
        self.stopping.set()
        self.shadow.close()
        self.candidate.stop()
        self.write()
        summary = self.shadow.summary()
        log.info("serve: shadow %s; report in %s", summary["requests"], self.report_dir)
