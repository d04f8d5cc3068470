"""Served latency: closed-loop streaming clients against a real server on loopback, and what they
measured (aggregate output tokens/s, time to first token and inter-token latency percentiles).

Used by benchmarks/serve_llm_load.py and by a served-latency gate: `served_load(artifact, ...)` starts
`python -m serve ARTIFACT` on 127.0.0.1 (a free port), drives `clients` concurrent streams with the
given prompts (token ids), stops the server and returns the figures. Clients are an httpx AsyncClient
in this process, one asyncio loop; requests and time are bounded.

With a `structured_share`, that share of the requests (spread evenly over the load) carry a
`response_format` json_schema (STRUCTURED_SCHEMA), and each constrained reply is parsed and validated
against it: the figures then hold a `structured` block (structured_summary).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # where `python -m serve` is found
PORT_LINE = re.compile(r"running on http://127\.0\.0\.1:(\d+)")


@dataclass
class Result:
    """One request as its client saw it."""

    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    status: int = 0
    error: str = ""
    text: str = ""  # the reply's text, streamed chunks joined
    finish_reason: str | None = None
    schema: dict | None = None  # the JSON schema the request asked the reply to match, if any
    retries: int = 0  # sent again after the connection closed before any response (see one_request)


# The schema a constrained request of the load asks for: small, and bounded in length (a short string,
# a bounded integer, no other key), so a reply ends well within a few dozen tokens on any engine.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}


def structured_response_format(schema: dict = STRUCTURED_SCHEMA) -> dict:
    """The `response_format` a constrained request sends (what `openai`'s parse() sends for a model)."""
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}


def carries_schema(index: int, share: float) -> bool:
    """Whether request `index` of a load (numbered round by round over the clients) is constrained:
    `share` of them, spread evenly (0.5: every second request, so half the clients at any time)."""
    return int((index + 1) * share + 1e-9) > int(index * share + 1e-9)


def structured_verdict(result: Result) -> str:
    """A constrained reply judged: "valid" (parses, matches its schema), "cut" (stopped by max_tokens
    before it was whole: not the engine's fault, not judged) or "invalid"."""
    import jsonschema_rs

    try:
        value = json.loads(result.text)
    except ValueError:
        value = None
    else:
        if jsonschema_rs.validator_for(result.schema or {}).is_valid(value):
            return "valid"
    return "cut" if result.finish_reason == "length" else "invalid"


def structured_summary(results: list[Result], share: float) -> dict:
    """What the constrained requests of a load returned: how many were sent, answered valid, cut by
    max_tokens, invalid (with up to three of the invalid texts), of those answered 200."""
    asked = [r for r in results if r.schema is not None]
    answered = [r for r in asked if r.status == 200 and not r.error]
    verdicts = [structured_verdict(r) for r in answered]
    return {
        "share": share,
        "requests": len(asked),
        "answered": len(answered),
        "valid": verdicts.count("valid"),
        "cut": verdicts.count("cut"),
        "invalid": verdicts.count("invalid"),
        "invalid_examples": [r.text[:120] for r, v in zip(answered, verdicts) if v == "invalid"][:3],
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


# A kept-alive connection the server closed as the request went out ends with no response at all;
# HTTP clients send such a request again (the openai SDK up to twice), so the load does too, and the
# time to first token still counts from the first try. llama-server closes idle connections this way.
CONNECTION_RETRIES = 2


async def one_request(
    client,
    url: str,
    model: str,
    prompt_ids: list[int],
    new_tokens: int,
    leave_after_first: bool = False,
    schema: dict | None = None,
) -> Result:
    """One streamed completion; TTFT and gaps are taken at text chunks (the usage chunk has none).
    With `schema`, the request asks for JSON matching it (response_format json_schema)."""
    import httpx

    payload = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema is not None:
        payload["response_format"] = structured_response_format(schema)
    result, start = Result(schema=schema), time.perf_counter()
    while True:
        try:
            await _stream_completion(client, url, payload, result, start, leave_after_first)
        except httpx.RemoteProtocolError as exc:
            if result.status or result.retries >= CONNECTION_RETRIES:
                result.error = f"{type(exc).__name__}: {exc}"[:200]
                break
            result.retries += 1
            continue
        except Exception as exc:  # counted, not raised: one failed request must not end the run
            result.error = f"{type(exc).__name__}: {exc}"[:200]
        break
    result.tokens = result.tokens or len(result.gaps_s) + (result.ttft_s is not None)
    return result


async def _stream_completion(client, url: str, payload: dict, result: Result, start: float, leave_after_first: bool):
    """Sends `payload` and fills `result` from the stream as it comes."""
    last = 0.0
    async with client.stream("POST", url + "/v1/completions", json=payload) as response:
        result.status = response.status_code
        if response.status_code != 200:
            result.error = (await response.aread()).decode(errors="replace")[:200]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.tokens = int(chunk["usage"].get("completion_tokens") or 0)
            choices = chunk.get("choices") or []
            if choices and choices[0].get("finish_reason"):
                result.finish_reason = choices[0]["finish_reason"]
            if not (choices and choices[0].get("text")):
                continue
            result.text += choices[0]["text"]
            now = time.perf_counter()
            if result.ttft_s is None:
                result.ttft_s = now - start
            else:
                result.gaps_s.append(now - last)
            last = now
            if leave_after_first:
                break


async def drive_async(
    url,
    model,
    prompts,
    clients,
    per_client,
    new_tokens,
    timeout_s,
    leave_share=0.0,
    structured_share=0.0,
    stop=lambda: False,  # true once the load is to end: no client sends another request
):
    import httpx

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def closed_loop(index: int) -> list[Result]:
            out = []
            for k in range(per_client):
                if stop():
                    break
                prompt = prompts[(index * per_client + k) % len(prompts)]
                leave = index < round(clients * leave_share)
                schema = STRUCTURED_SCHEMA if carries_schema(k * clients + index, structured_share) else None
                out.append(await one_request(client, url, model, prompt, new_tokens, leave, schema))
            return out

        start = time.perf_counter()
        per = await asyncio.wait_for(asyncio.gather(*(closed_loop(i) for i in range(clients))), timeout_s * 4)
        wall = time.perf_counter() - start
    return [r for rs in per for r in rs], wall


def drive(
    url: str,
    model: str,
    prompts,
    clients: int,
    per_client: int,
    new_tokens: int,
    timeout_s: float = 120,
    structured_share: float = 0.0,
    stop=lambda: False,
):
    """Closed-loop load: `clients` concurrent streams, each sending `per_client` requests in turn
    (`structured_share` of them constrained to STRUCTURED_SCHEMA) until `stop()`. Returns the figures
    a report (or a gate) reads."""
    results, wall = asyncio.run(
        drive_async(url, model, prompts, clients, per_client, new_tokens, timeout_s, 0.0, structured_share, stop)
    )
    figures = summarize(results, wall, clients)
    if structured_share > 0:
        figures["structured"] = structured_summary(results, structured_share)
    return figures


def summarize(results: list[Result], wall: float, clients: int) -> dict:
    ok = [r for r in results if r.status == 200 and not r.error]  # an answer with no text (EOS first) is ok
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.tokens for r in ok)
    ms = lambda v: None if v is None else round(v * 1e3, 1)  # noqa: E731
    return {
        "clients": clients,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "retried": sum(1 for r in results if r.retries),
        "errors": sorted({r.error or str(r.status) for r in results if r not in ok})[:3],
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 1) if wall else None,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p95_ms": ms(percentile(ttft, 95)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(gaps, 50)),
        "itl_p95_ms": ms(percentile(gaps, 95)),
    }


class ServerNotReady(RuntimeError):
    """The server exited, refused the readiness check or was not ready in time (one line: which).
    `signal_name`: the signal that ended it, where one did (SIGSEGV, SIGILL...), else None."""

    def __init__(self, message: str, signal_name: str | None = None):
        super().__init__(message)
        self.signal_name = signal_name


def signal_of(returncode: int) -> str | None:
    """The name of the signal that ended a process (Popen's negative return code), else None."""
    try:
        return signal.Signals(-returncode).name if returncode < 0 else None
    except ValueError:  # not a signal this platform names
        return None


def exit_status(returncode: int) -> str:
    """A process's return code as a person reads it: `2`, or `-11 (SIGSEGV)` where a signal ended it."""
    name = signal_of(returncode)
    return f"{returncode} ({name})" if name else str(returncode)


class ServedServer:
    """A server process on loopback; the port from its startup line, ready once `ready_path` answers.
    `unset`: variables of this environment the server does not inherit. `own_session`: the server
    leaves the terminal's process group, so a Ctrl-C reaches only the caller, which stops it."""

    def __init__(
        self,
        name: str,
        command: list[str],
        ready_path: str,
        env: dict | None = None,
        port: int | None = None,
        unset: tuple[str, ...] = (),
        own_session: bool = False,
    ):
        self.name, self.ready_path = name, ready_path
        self.lines: list[str] = []
        environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=own_session,
        )
        self.port: int | None = port  # known when the command names it; else read from the startup line
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            match = PORT_LINE.search(line)
            if match and self.port is None:
                self.port = int(match.group(1))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300, stop=lambda: False) -> None:
        """Return once ready; ServerNotReady at once when the server exits or answers the readiness
        check with a 4xx (it will never be ready: an API key it wants, a path it lacks), else after
        `timeout` s (loading answers 503 or not at all). Returns early when `stop()`."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop():
            if self.proc.poll() is not None:
                self.reader.join(5)  # its last lines say why
                code = self.proc.returncode
                why = f"{self.name} exited with {exit_status(code)}: {self.last_lines()}"
                raise ServerNotReady(why, signal_of(code))
            status = None
            if self.port:
                with contextlib.suppress(httpx.HTTPError):
                    status = httpx.get(self.url + self.ready_path, timeout=2).status_code
            if status == 200:
                return
            if status is not None and 400 <= status < 500:
                raise ServerNotReady(f"{self.name} answered {self.ready_path} with {status}: {self.last_lines()}")
            time.sleep(0.2)
        if not stop():
            raise ServerNotReady(f"{self.name} not ready after {timeout:.0f} s: {self.last_lines()}")

    def last_lines(self) -> str:
        return " | ".join(line.strip() for line in self.lines[-3:] if line.strip()) or "no output"

    def rss_mb(self) -> float:
        import psutil

        proc = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20

    def cpu_seconds(self) -> float:
        import psutil

        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(self.proc.pid)
            return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def served_load(
    artifact: Path,
    prompts: list[list[int]],
    clients: int,
    requests_per_client: int = 2,
    new_tokens: int = 64,
    flags: tuple[str, ...] = (),
    timeout_s: float = 120,
    structured_share: float = 0.0,
    ready_timeout_s: float = 300,
) -> dict:
    """Start the real server on the artifact, warm it with one request, drive the load, stop it.
    The artifact need not have passed its gate yet (the gate is what this measures for).

    The server's environment is this one without SERVE_API_KEY: it serves only this load's clients,
    on loopback, which send no key. A server that is never ready raises ServerNotReady (one line).
    SIGINT or SIGTERM meanwhile ends the load (no client sends another request), the server is
    stopped, and the signal is then handled as it would have been (KeyboardInterrupt for Ctrl-C)."""
    from serve.config import API_KEY_ENV

    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    model = (manifest.get("recipe") or {}).get("name") or Path(artifact).name
    command = [sys.executable, "-m", "serve", str(artifact), "--port", "0", "--allow-failed-gate", "--allow-modified"]
    with signals_deferred() as stopping:
        server = ServedServer("serve", [*command, *flags], "/v2/health/ready", unset=(API_KEY_ENV,), own_session=True)
        try:
            server.wait_ready(ready_timeout_s, stop=stopping)
            asyncio.run(drive_async(server.url, model, prompts[-1:], 1, 1, 8, timeout_s, stop=stopping))
            return drive(
                server.url,
                model,
                prompts,
                clients,
                requests_per_client,
                new_tokens,
                timeout_s,
                structured_share,
                stop=stopping,
            )
        finally:
            server.stop()


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM recorded while the block runs (it reads `stopping()` to end early), then
    raised again once it has ended, to the handlers there were before: the server is stopped first,
    and an interrupt does not depend on asyncio's cancellation of the load's task reaching it (a
    Ctrl-C was seen ignored, the load running to its end: a cancellation can be lost on the way,
    e.g. once every client's last request is done but before the gather has returned). Outside the
    main thread: nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in SIGNALS}
    try:
        yield lambda: bool(received)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            signal.raise_signal(received[0])


SIGNALS = (signal.SIGINT, signal.SIGTERM)
