"""The shadow cannot loop and its settings are checked at startup: a candidate URL that is the server
itself (by any name or address that reaches it) is refused in one line; a URL that does not parse, a
port out of range, a bad host, a report folder it cannot write, and --shadow-* without --shadow are
one line and exit 2 before the model loads; and a request the shadow sent (it carries the mark) is
answered but never shadowed again, so two servers shadowing each other compare each request once."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from serve.__main__ import main
from serve.shadow.candidate import free_port, self_problem
from serve.shadow.report import folder_problem
from serve.shadow.traffic import MARK
from tests.serve.test_shadow import TEXTS, burst, shadow_metric
from tests.support.serve import ServerProcess, wait_until


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--shadow-queue", "8"], "--shadow-queue set the shadow, which runs only with --shadow"),
        (["--shadow-threads", "2"], "--shadow-threads set the shadow"),
        (["--shadow-timeout-s", "5"], "--shadow-timeout-s set the shadow"),
        (["--shadow-report", "r", "--shadow-queue", "8"], "--shadow-queue, --shadow-report set the shadow"),
        (["--shadow", "http://127.0.0.1:99999"], "Port out of range"),
        (["--shadow", "http://[::1"], "Invalid IPv6 URL"),
        (["--shadow", "http://127.0.0.1:0"], "the port must be from 1 to 65535"),
        (["--shadow", "http://bad..host:8001"], "'bad..host' is not a host name or an IP address"),
        (["--shadow", "http://256.1.1.1:8001"], "not a valid IPv4 address"),
        (["--shadow", "ftp://127.0.0.1:8001"], "the URL must start with http://"),
        (["--shadow", "http://127.0.0.1:8001/v1?x=1"], "give only the scheme, host and port"),
        (
            ["--shadow", "http://127.0.0.1:8001", "--shadow-report", "/proc/no/report"],
            "--shadow-report /proc/no/report",
        ),
        (["--shadow", "http://127.0.0.1:8001", "--shadow-queue", "0"], "--shadow-queue: must be >= 1"),
        (["--shadow", "http://127.0.0.1:8001", "--shadow-timeout-s", "nan"], "--shadow-timeout-s: must be a finite"),
        (["--shadow", "http://127.0.0.1:8001", "--shadow-timeout-s", "1e300"], "--shadow-timeout-s: must be <= 3600"),
    ],
)
def test_bad_shadow_settings_are_one_line_before_anything_loads(flags, fragment, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default report folder is created here
    err = refused([str(tmp_path / "no-artifact"), "--port", str(free_port()), *flags], capsys)
    assert fragment in err, err


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost", "127.0.0.2"])
def test_a_candidate_that_is_the_server_itself_is_refused(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    port = free_port()
    err = refused([str(tmp_path), "--port", str(port), "--shadow", f"http://{name}:{port}"], capsys)
    assert f"is this server itself (127.0.0.1:{port})" in err


def test_every_local_address_is_the_server_when_it_listens_on_all_of_them():
    port = free_port()
    own = socket.gethostbyname(socket.gethostname())
    for name in ("127.0.0.1", "localhost", "0.0.0.0", own):
        assert self_problem(f"http://{name}:{port}", "0.0.0.0", port), name
    assert self_problem(f"http://[::1]:{port}", "::1", port)
    # Another port, a remote address (TEST-NET-1, which no host holds), or a port still to be picked: not itself.
    assert self_problem(f"http://127.0.0.1:{port + 1}", "127.0.0.1", port) is None
    assert self_problem(f"http://192.0.2.1:{port}", "0.0.0.0", port) is None
    assert self_problem(f"http://127.0.0.1:{port}", "127.0.0.1", 0) is None


def test_the_report_folder_is_probed_at_startup_and_left_empty(tmp_path):
    folder = tmp_path / "new" / "report"
    assert folder_problem(folder) is None
    assert folder.is_dir() and list(folder.iterdir()) == []  # the probe file is gone
    (tmp_path / "file").write_text("x")
    assert "cannot write the report there" in folder_problem(tmp_path / "file")
    assert "cannot write the report there" in folder_problem(tmp_path / "file" / "below")


@pytest.mark.slow
def test_a_server_started_shadowing_itself_is_refused(encoder_artifact, tmp_path):
    import subprocess
    import sys

    from tests.support.cli import one_error_line
    from tests.support.serve import ROOT

    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "serve", str(encoder_artifact), "--port", str(port)]
        + ["--shadow", f"http://localhost:{port}", "--shadow-report", str(tmp_path / "r")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error_line(proc, f"http://localhost:{port} is this server itself", log_lines=True)


def offered(server: ServerProcess) -> float:
    """Every request the server's shadow was offered, whatever became of it."""
    return sum(shadow_metric(server.url, o) for o in ("compared", "failed", "dropped", "not_ready"))


@pytest.mark.slow
def test_two_servers_shadowing_each_other_compare_each_request_once(encoder_artifact, encoder_name, tmp_path):
    port_a, port_b = free_port(), free_port()
    common = ["--threads", "1", "--shadow-timeout-s", "10", "--shadow-queue", "64"]
    a = ServerProcess(
        encoder_artifact, "--port", str(port_a), "--shadow", f"http://127.0.0.1:{port_b}",
        "--shadow-report", str(tmp_path / "a"), *common,
    )  # fmt: skip
    b = ServerProcess(
        encoder_artifact, "--port", str(port_b), "--shadow", f"http://127.0.0.1:{port_a}",
        "--shadow-report", str(tmp_path / "b"), *common,
    )  # fmt: skip
    try:
        a.wait_ready(timeout=120), b.wait_ready(timeout=120)
        wait_until(lambda: "shadow candidate ready" in a.output and "shadow candidate ready" in b.output, timeout=60)
        # A request that carries the mark is answered and not shadowed.
        marked = httpx.post(
            a.url + "/v1/embeddings", json={"model": encoder_name, "input": TEXTS}, headers={MARK: "1"}, timeout=60
        )
        assert marked.status_code == 200 and offered(a) == 0
        assert burst(a.url, encoder_name, 20) == [200] * 20
        wait_until(lambda: shadow_metric(a.url, "compared") >= 20, timeout=120)
        time.sleep(3)  # a loop would keep growing from here
        assert offered(a) == 20 and shadow_metric(a.url, "compared") == 20
        assert offered(b) == 0  # b answered a's 20 copies and shadowed none of them back
    finally:
        assert a.terminate() == 0, a.output
        assert b.terminate() == 0, b.output
