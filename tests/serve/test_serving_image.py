"""The serving images (serve/Dockerfile.cpu, serve/Dockerfile.gpu), checked without Docker: the base
image and every Python package pinned to one version; the CPU image installs what every engine format
the pipeline ships for CPUs needs to be served (read from the engine table, engines/formats.py); a
format whose packages are missing is refused at startup by name; and the CPU image's own install
steps, replayed on this environment, serve a native-gguf artifact with the root filesystem's folders
unwritable (HOME) and only the deployment's emptyDirs to write to."""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engines import formats
from tests.support import dockerfile
from tests.support.serve import ROOT

CPU = ROOT / "serve" / "Dockerfile.cpu"
GPU = ROOT / "serve" / "Dockerfile.gpu"
EXACT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?==[A-Za-z0-9.+!]+$")
VERSION_TAG = re.compile(r":[^:/@]*\d[^:/@]*$")  # a tag holding a version number (not latest, not a name)
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
# The markers pip evaluates in the CPU image (python:3.11 on Debian, x86-64).
IMAGE_MARKERS = {
    "python_version": "3.11",
    "python_full_version": "3.11.11",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def canonical(name: str) -> str:
    from packaging.utils import canonicalize_name

    return canonicalize_name(name)


@pytest.mark.parametrize("image", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_pip_requirement_is_pinned_to_one_version(image):
    installs = dockerfile.pip_installs(image)
    assert installs
    for install in installs:
        assert install.requirements, f"{image.name}: a pip install with no requirement"
        for requirement in install.requirements:
            assert EXACT.match(requirement), f"{image.name}: {requirement!r} is not pinned with =="
        assert not install.options, f"{image.name}: pip options {install.options} (an index or a file would unpin)"


def test_the_pin_check_refuses_a_range(tmp_path):
    """The check reads what it claims: a range, a bare name and a requirements file are all caught."""
    bad = tmp_path / "Dockerfile"
    bad.write_text('FROM python:3.11.11-slim\nRUN pip install "numpy>=1.26" starlette \\\n    -r reqs.txt\n')
    (install,) = dockerfile.pip_installs(bad)
    assert [r for r in install.requirements if not EXACT.match(r)] == ["numpy>=1.26", "starlette", "reqs.txt"]
    assert install.options == ("-r",)


@pytest.mark.parametrize("image", [CPU, GPU], ids=["cpu", "gpu"])
def test_the_base_image_is_pinned_by_version(image):
    for base in dockerfile.base_images(image):
        name = DIGEST.sub("", base)
        assert VERSION_TAG.search(name), f"{image.name}: FROM {base} names no version"
        assert not name.endswith(":latest")
    if image == CPU:
        assert all(DIGEST.search(b) for b in dockerfile.base_images(image)), "the CPU base is pinned by digest too"


def served_on_cpu() -> list[formats.EngineFormat]:
    return [f for f in formats.FORMATS.values() if f.serves is not None and not f.gpu_only]


def test_the_cpu_image_installs_what_every_cpu_format_needs_to_be_served():
    """From the engine table: each served format's Python packages (one of the distributions that
    install its module) and Debian packages, with the build arguments' defaults; and the base install
    and the serve extra of pyproject.toml."""
    pinned = dockerfile.pins(CPU)
    apt = dockerfile.apt_packages(CPU)
    import tomllib  # Python 3.11+, as the images' Python

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    from packaging.requirements import Requirement

    for text in [*project["dependencies"], *project["optional-dependencies"]["serve"]]:
        assert canonical(Requirement(text).name) in pinned, f"{text}: not installed by the CPU image"
    assert served_on_cpu()
    for engine_format in served_on_cpu():
        for package in engine_format.serve_packages:
            assert {canonical(d) for d in package.dists} & set(pinned), (
                f"{engine_format.name}: the CPU image installs none of {package.dists} (module {package.module})"
            )
        missing = set(engine_format.serve_debian) - apt
        assert not missing, f"{engine_format.name}: the CPU image's apt-get install lacks {sorted(missing)}"
    assert formats.get(formats.NATIVE_GGUF).serve_debian, "the native kernels need a compiler"


def test_what_a_build_argument_leaves_out_is_seen_as_left_out(tmp_path):
    """A pip install behind a build argument counts only when the argument's default runs it."""
    text = CPU.read_text().replace("ARG WITH_OPENVINO=1", "ARG WITH_OPENVINO=0")
    off = tmp_path / "Dockerfile"
    off.write_text(text)
    assert "openvino-genai" in dockerfile.pins(CPU) and "openvino-genai" not in dockerfile.pins(off)


# --- what serve does without a format's packages -----------------------------------------------


def fake_artifact(root: Path, engine: dict) -> Path:
    """An artifact that passes verification, of this engine block (its folder holds a placeholder:
    serve must refuse before it reads it)."""
    from tests.support.tiny_llm import write_manifest

    (root / engine["dir"]).mkdir(parents=True)
    (root / engine["dir"] / "placeholder").write_text("not a model\n")
    write_manifest(root, engine)
    return root


def serve_exits(artifact: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "serve", str(artifact), "--port", "0"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    return errors[0]


def test_a_format_whose_package_is_not_installed_is_refused_by_name_at_startup(tmp_path):
    """openvino_genai not importable (a stand-in module that fails as a missing one does): one line
    naming the format and the package, exit 2, before the port opens (it used to be a load error in a
    worker thread after startup, exit 1)."""
    from tests.support.tiny_llm import OPENVINO_ENGINE

    hidden = tmp_path / "hidden"
    (hidden / "openvino_genai").mkdir(parents=True)
    (hidden / "openvino_genai" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'openvino_genai'\", name='openvino_genai')\n"
    )
    artifact = fake_artifact(tmp_path / "artifact", OPENVINO_ENGINE)
    line = one_line_error(serve_exits(artifact, {"PYTHONPATH": str(hidden)}))
    assert "engine format 'openvino-genai'" in line and "openvino-genai" in line.split("package", 1)[1], line
    assert "Uvicorn running" not in line


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is not None, reason="tensorrt-rtx is installed here")
def test_a_gpu_format_on_a_machine_without_its_runtime_is_refused_by_name(tmp_path):
    artifact = fake_artifact(
        tmp_path / "artifact", {"format": "tensorrt-rtx", "dir": "plan", "file": "plan/placeholder"}
    )
    line = one_line_error(serve_exits(artifact, {}))
    assert "engine format 'tensorrt-rtx'" in line and "tensorrt-rtx" in line.split("package", 1)[1], line


def test_the_native_engine_without_a_c_compiler_is_refused_by_name(tmp_path):
    """No cc on PATH and no $CC: one line naming the format and the compiler, exit 2, before loading."""
    engine = {"format": formats.NATIVE_GGUF, "dir": "native_gguf", "gguf": "placeholder", "context": 64}
    artifact = fake_artifact(tmp_path / "artifact", engine)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    proc = subprocess.run(
        [sys.executable, "-m", "serve", str(artifact), "--port", "0"],
        cwd=ROOT,
        env={**env, "PATH": str(empty)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = one_line_error(proc)
    assert "engine format 'native-gguf'" in line and ("C compiler" in line or "AVX2" in line or "x86-64" in line), line


def test_every_format_this_environment_installs_passes_the_startup_check():
    """Where the packages are here, the check lets the format through (no false refusals)."""
    for engine_format in served_on_cpu():
        importable = all(importlib.util.find_spec(p.module) for p in engine_format.serve_packages)
        if importable and engine_format.serve_check is None:
            assert engine_format.serving_unavailable() is None, engine_format.name


# --- the image's install steps, replayed here --------------------------------------------------


def image_requirements_closure_problems(pinned: dict[str, str]) -> list[str]:
    """What the pins lack to be the image's whole install: a dependency (for the image's Python and
    platform) of a pinned distribution that is not pinned itself."""
    from packaging.requirements import Requirement

    problems = []
    for name in pinned:
        for text in importlib.metadata.requires(name) or ():
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate(IMAGE_MARKERS):
                continue
            if canonical(requirement.name) not in pinned:
                problems.append(f"{name} needs {requirement}, which the image does not pin")
    return problems


@pytest.mark.slow
def test_this_environment_holds_the_cpu_image_s_exact_pins_and_they_are_complete():
    """Every package the CPU image pins (every build argument on) is installed here at that version,
    and the pins hold every dependency of every pinned package: the image installs what the tests ran."""
    pinned = dockerfile.pins(CPU, by_default_only=False)
    differ = []
    for name, version in pinned.items():
        try:
            here = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            here = "not installed"
        if here != version:
            differ.append(f"{name}: the image pins {version}, this environment has {here}")
    assert not differ, "\n".join(differ)
    assert image_requirements_closure_problems(pinned) == []


def emptydir_env(workdir: Path, home: Path) -> dict[str, str]:
    """The image's ENV, each folder the deployment mounts an emptyDir on replaced by a fresh one here,
    HOME by a folder nobody can create (as the read-only root filesystem leaves it)."""
    from tests.serve.test_deploy_manifests import pod_specs

    pod = pod_specs("kubernetes")[0]
    empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if m["name"] in empty_dirs}
    env = dockerfile.env(CPU) | {e["name"]: e["value"] for e in container["env"] if "value" in e}
    replaced = {}
    for name, value in env.items():
        mount = next((m for m in mounts if value == m or value.startswith(m + "/")), None)
        if mount is None:
            replaced[name] = value
            continue
        folder = workdir / "volumes" / mounts[mount]
        folder.mkdir(parents=True, exist_ok=True)
        replaced[name] = str(folder) + value[len(mount) :]
    replaced["HOME"] = str(home)
    for name in ("OPTIMIZE_CACHE", "XDG_CONFIG_HOME", "TMPDIR"):
        assert replaced[name].startswith(str(workdir / "volumes")), f"{name} is on no emptyDir"
    return replaced


@contextlib.contextmanager
def image_server(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 300):
    """The server process, its output drained by a thread; yields its URL once /v2/health/ready is 200."""
    import httpx

    from tests.support.serve import PORT_LINE, wait_until

    lines: list[str] = []
    port: list[int] = []

    def drain() -> None:
        for line in proc.stdout or ():
            lines.append(line)
            if not port and (match := PORT_LINE.search(line)):
                port.append(int(match.group(1)))

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{''.join(lines)}")
        with contextlib.suppress(httpx.HTTPError):
            return bool(port) and httpx.get(f"http://127.0.0.1:{port[0]}/v2/health/ready", timeout=2).status_code == 200
        return False

    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=drain, daemon=True).start()
    try:
        try:
            wait_until(ready, timeout=timeout, step=0.25)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{''.join(lines)}") from None
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def image_workdir(workdir: Path) -> Path:
    """WORKDIR with the Dockerfile's COPY lines done: only what the image copies is importable there."""
    app = workdir / "app"
    for source, destination in dockerfile.copies(CPU):
        shutil.copytree(ROOT / source, app / destination, ignore=shutil.ignore_patterns("__pycache__"))
    return app


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_image_s_install_steps_serve_a_native_gguf_artifact_with_only_emptydirs_writable(tmp_path):
    """`python -m serve` as the image runs it: from a WORKDIR holding only what the Dockerfile copies,
    this environment's packages without the project's own install (python -S: no .pth files), the
    image's ENV with the deployment's emptyDirs as fresh folders and HOME one nobody can create, the
    Deployment's flags (a signed artifact, an API key). It compiles the native kernels into the
    emptyDir cache and answers a chat completion."""
    import httpx

    from engines.native_gguf import build
    from tests.serve.test_deploy_manifests import pod_specs
    from tests.support.native_gguf_artifact import native_gguf_artifact

    reason = build.unavailable()
    if reason:
        pytest.skip(reason)
    key = os.urandom(32).hex().encode()
    (tmp_path / "serve-key").write_bytes(key)
    artifact = native_gguf_artifact(tmp_path / "artifact", key)
    home = Path("/proc/optimize-serve-home")  # not creatable, even by root
    env = emptydir_env(tmp_path, home)
    app = image_workdir(tmp_path)
    site_packages = [p for p in sys.path if p.endswith("site-packages")]
    (container,) = pod_specs("kubernetes")[0]["containers"]
    flags = [a for a in container["args"][1:] if not a.startswith(("--host", "--port"))]
    assert "--require-signature" in flags
    env |= {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": os.pathsep.join(site_packages),
        "ARTIFACT_VERIFY_KEY": str(tmp_path / "serve-key"),
        "SERVE_API_KEY": "deploy-test-key",
    }
    isolated = subprocess.run([sys.executable, "-S", "-c", "import optimize"], cwd=app, env=env, capture_output=True)
    assert isolated.returncode != 0, "the pipeline is importable: the image does not copy it"
    command = [sys.executable, "-S", "-m", "serve", str(artifact), *flags, "--host", "127.0.0.1", "--port", "0"]
    with image_server(command, app, env) as url:
        reply = httpx.post(
            url + "/v1/chat/completions",
            headers={"Authorization": "Bearer deploy-test-key"},
            json={
                "model": "tiny_gguf",
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": 8,
                "seed": 3,
            },
            timeout=120,
        )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] > 0 and isinstance(body["choices"][0]["message"]["content"], str)
    compiled = list(Path(env["OPTIMIZE_CACHE"]).rglob("*.so"))
    assert compiled, f"no kernels in the emptyDir cache {env['OPTIMIZE_CACHE']}"
    assert not home.exists()
