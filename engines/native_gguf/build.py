"""Compiling the native GGUF kernels on the machine that runs them, and loading them only sealed.

kernels.c is built with -march=native, so the library is this CPU's (its AVX-512 VNNI path where the
CPU has it, else its AVX2 one): it is cached under a key of the source, the compiler, the flags and
the CPU's flags, and a CPU with neither is refused before anything is compiled, naming what it lacks.
$OPTIMIZE_NATIVE_MARCH sets another -march (x86-64-v3: the AVX2 path on any AVX2 CPU);
$OPTIMIZE_NATIVE_SANITIZE (or `sanitize=`) builds with -fsanitize=... (the tests' AddressSanitizer
lane), cached under its own key.

The cache is untrusted input and a shared library runs code the moment it is loaded (its
constructors), so the library is loaded only when it checks out against the record sealed beside it
when it was compiled: its sha256 and the build key (source hash, compiler, flags, CPU flags), with an
HMAC-SHA256 under the cache key (engines/cache.py, the key optimize/cache_store.py's records use).
It is hashed through the descriptor it is then loaded from, so a file swapped after the check is not
the one loaded. Anything that does not verify is removed and rebuilt, and the log says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from engines.cache import cache_key, cache_root, signature
from engines.hardware import cpu_flags

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("kernels.c")
LIBRARY = "libnative_gguf.so"
RECORD = "cache-record.json"
SCHEME = "native-gguf-build-v1"
MAX_RECORD_BYTES = 1 << 16
# /proc/cpuinfo's names for what each of kernels.c's paths uses: 512-bit integer and float vectors with
# VNNI's u8 x s8 dot products, or 256-bit ones with FMA; f16 conversions in both.
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "f16c")
AVX2_FLAGS = ("avx2", "fma", "f16c")
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
SANITIZE_ENV = "OPTIMIZE_NATIVE_SANITIZE"
_LOADED: dict[str, ctypes.CDLL] = {}  # sha256 -> the library loaded in this process
_NAMES_USED: set[str] = set()  # the /proc/self/fd names the loader has seen


class NativeBuildError(RuntimeError):
    """The kernels cannot be built or run here (one line: the CPU, the compiler, the cache, or its error)."""


def unsupported_cpu(flags: frozenset[str] | None = None, machine: str | None = None) -> str | None:
    """Why this CPU cannot run the kernels, or None."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return f"the native GGUF kernels are x86-64 AVX-512 code; this machine is {machine}"
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in AVX2_FLAGS if f not in flags]
    if missing:
        return f"the native GGUF kernels need AVX2 with FMA and F16C; this CPU lacks {', '.join(missing)}"
    return None


def path(flags: frozenset[str] | None = None) -> str:
    """Which of the kernels' paths this CPU runs (where nothing else is asked for)."""
    flags = cpu_flags() if flags is None else flags
    return "AVX-512 VNNI" if all(f in flags for f in VNNI_FLAGS) else "AVX2"


def march() -> str:
    return os.environ.get("OPTIMIZE_NATIVE_MARCH") or "native"


def unavailable() -> str | None:
    """Why the kernels cannot be built here (the CPU, or no C compiler), or None."""
    if reason := unsupported_cpu():
        return reason
    try:
        compiler()
    except NativeBuildError as exc:
        return str(exc)
    return None


def compiler() -> list[str]:
    """The C compiler's command line: $CC split as a shell splits it (make runs `$(CC) ...` through
    one, so CC="ccache gcc" or CC="gcc -m64" work there and here), else cc or gcc on the PATH. Its
    first word must name an executable file: anything else is one line, not a traceback."""
    configured = os.environ.get("CC", "").strip()
    if not configured:
        found = shutil.which("cc") or shutil.which("gcc")
        if not found:
            raise NativeBuildError("the native GGUF kernels need a C compiler with OpenMP (install gcc, or set $CC)")
        return [found]
    try:
        words = shlex.split(configured)
    except ValueError as exc:
        raise NativeBuildError(f"$CC={configured[:80]!r} cannot be split into a command line ({exc})") from None
    program = shutil.which(words[0]) if words else None
    if not program:
        raise NativeBuildError(
            f"$CC={configured[:80]!r}: {words[0][:80]!r} is not an executable file on this machine "
            "(the native GGUF kernels need a C compiler with OpenMP)"
        )
    return [program, *words[1:]]


def sanitizer(sanitize: str | None = None) -> list[str]:
    """-fsanitize flags for a checked build (`sanitize` or $OPTIMIZE_NATIVE_SANITIZE: e.g. "address,undefined")."""
    chosen = sanitize if sanitize is not None else os.environ.get(SANITIZE_ENV, "")
    if not chosen:
        return []
    if not all(part.isalpha() for part in chosen.split(",")):
        raise NativeBuildError(f"sanitizer {chosen[:60]!r} is not a comma-separated list of names (address,undefined)")
    return [f"-fsanitize={chosen}", "-fno-omit-frame-pointer", "-g"]


def _run(cc: list[str], args: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([*cc, *args], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(f"cannot run the C compiler {shlex.join(cc)[:120]}: {exc}") from None


def build_key(cc: list[str], flags: list[str]) -> dict:
    """What the library is a function of: the source, the compiler (and its version), the flags and
    the CPU's flags. The folder name is its hash; the sealed record holds it whole."""
    version = _run(cc, ["--version"]).stdout.splitlines()[:1]
    return {
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "compiler": cc,
        "compiler_version": version,
        "flags": flags,
        "cpu_flags": sorted(cpu_flags()),
    }


def library(sanitize: str | None = None) -> Path:
    """The cached kernels' library path, compiled once and sealed (`load` is what loads it)."""
    return _prepare(sanitize)[0] / LIBRARY


def load(sanitize: str | None = None) -> ctypes.CDLL:
    """The kernels' library, compiled here once into the cache and loaded only when its sealed record
    verifies (checked through the descriptor it is loaded from). NativeBuildError in one line otherwise."""
    loaded = _load_verified(*_prepare(sanitize))
    if loaded is None:  # replaced between the check and the load: built again, once
        loaded = _load_verified(*_prepare(sanitize))
    if loaded is None:
        raise NativeBuildError("the compiled kernels in the cache keep failing their check (something replaces them)")
    return loaded


def _prepare(sanitize: str | None) -> tuple[Path, dict, bytes]:
    """(the folder of the verified library, its build, the cache key): built and sealed when missing
    or failing its check."""
    reason = unsupported_cpu()
    if reason:
        raise NativeBuildError(reason)
    cc = compiler()
    flags = [*FLAGS, f"-march={march()}", *sanitizer(sanitize)]
    build = build_key(cc, flags)
    key = _key()
    folder = _folder(build)
    why = verify(folder, build, key)
    if why:
        if why != "not built":
            log.warning("native GGUF kernels: the cached library under %s is not used, rebuilt: %s", folder, why)
            discard(folder)
        _compile_sealed(cc, flags, build, key, folder)
    return folder, build, key


def _key() -> bytes:
    from engines.artifact import ArtifactError

    try:
        key = cache_key()
    except ArtifactError as exc:  # an unsafe key file: the one line that says so
        raise NativeBuildError(str(exc)) from None
    if key is None:
        raise NativeBuildError(
            "no cache key could be read or made to seal the compiled kernels with "
            "(set $OPTIMIZE_CACHE_KEY to a private file holding a secret of at least 16 bytes)"
        )
    return key


def _folder(build: dict) -> Path:
    digest = hashlib.sha256(json.dumps(build, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_root() / "native-gguf"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(f"cannot use the cache folder {root} ($OPTIMIZE_CACHE): {exc.strerror or exc}") from None
    if not root.is_dir():
        raise NativeBuildError(f"cannot use the cache folder {root} ($OPTIMIZE_CACHE): not a folder")
    return root / digest


def _record_body(build: dict, library_sha256: str) -> dict:
    return {"scheme": SCHEME, "build": build, "library_sha256": library_sha256}


def verify(folder: Path, build: dict, key: bytes) -> str:
    """ "" when `folder` holds exactly the library its signed record names, built from `build`;
    otherwise why not ("not built" where nothing is there)."""
    if not os.path.lexists(folder):
        return "not built"
    if folder.is_symlink() or not folder.is_dir():
        return "it is not a folder"
    record, why = _read_record(folder, build, key)
    if why:
        return why
    names = sorted(p.name for p in folder.iterdir())
    if names != sorted([LIBRARY, RECORD]):
        return f"it holds other files than the library and its record ({', '.join(names[:5])})"
    fd, why = _open_library(folder / LIBRARY)
    if fd is None:
        return why
    try:
        if _sha256_fd(fd) != record["library_sha256"]:
            return "the library differs from the one its record names"
    finally:
        os.close(fd)
    return ""


def _read_record(folder: Path, build: dict, key: bytes) -> tuple[dict, str]:
    import hmac

    path = folder / RECORD
    try:
        if path.is_symlink() or not path.is_file():
            return {}, "it has no build record"
        if path.stat().st_size > MAX_RECORD_BYTES:
            return {}, "its build record is oversized"
        record = json.loads(path.read_text())
        body, signed = record["body"], record["signature"]
        if not isinstance(body, dict) or not isinstance(signed, str):
            raise TypeError("malformed")
    except (OSError, ValueError, KeyError, TypeError):
        return {}, "its build record is unreadable"
    if not hmac.compare_digest(signed, signature(key, body)):
        return {}, "its build record is not signed with this machine's cache key ($OPTIMIZE_CACHE_KEY)"
    if body.get("scheme") != SCHEME or body.get("build") != build or not isinstance(body.get("library_sha256"), str):
        return {}, "its build record is for another source, compiler, flags or CPU"
    return body, ""


def _open_library(path: Path) -> tuple[int | None, str]:
    """A read-only descriptor of a regular, single-link file at `path` (no link followed), or (None, why)."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return None, f"its library cannot be opened ({exc.strerror or exc})"
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
        os.close(fd)
        return None, "its library is not a regular single-link file"
    return fd, ""


def _sha256_fd(fd: int) -> str:
    digest = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def _load_verified(folder: Path, build: dict, key: bytes) -> ctypes.CDLL | None:
    """Hash the library through one descriptor and load it through that same descriptor
    (/proc/self/fd), so what is loaded is what was checked. None where it no longer verifies."""
    record, why = _read_record(folder, build, key)
    if why:
        return None
    fd, _ = _open_library(folder / LIBRARY)
    if fd is None:
        return None
    extra: list[int] = []
    try:
        digest = _sha256_fd(fd)
        if digest != record["library_sha256"]:
            return None
        if digest in _LOADED:  # the very same code, loaded already
            return _LOADED[digest]
        # The loader knows a library by its path name: "/proc/self/fd/N" once loaded stands for that
        # library for good, so another library is loaded through a descriptor number not used before.
        while f"/proc/self/fd/{(extra or [fd])[-1]}" in _NAMES_USED:
            extra.append(os.dup(fd))
        name = f"/proc/self/fd/{(extra or [fd])[-1]}"
        try:
            loaded = ctypes.CDLL(name)
        except OSError as exc:
            raise NativeBuildError(f"the compiled kernels cannot be loaded: {str(exc).splitlines()[0][:200]}") from None
        _NAMES_USED.add(name)
        _LOADED[digest] = loaded
        return loaded
    finally:
        for descriptor in (fd, *extra):
            os.close(descriptor)


def _compile_sealed(cc: list[str], flags: list[str], build: dict, key: bytes, folder: Path) -> None:
    """Compile into a staging folder unique to this run, seal it (the library's sha256 and the build,
    signed) and rename it into place: runs sharing the cache never see a half-built library."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    except OSError as exc:
        raise NativeBuildError(f"cannot write the cache folder {folder.parent}: {exc.strerror or exc}") from None
    try:
        built = staging / LIBRARY
        done = _run(cc, [*flags, "-o", str(built), str(SOURCE), "-lm"])
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["no output"]
            said = next((line for line in lines if "error" in line), lines[-1])  # the compiler's error, not its notes
            raise NativeBuildError(f"compiling the native GGUF kernels with {shlex.join(cc)[:80]} failed: {said[:200]}")
        body = _record_body(build, hashlib.sha256(built.read_bytes()).hexdigest())
        (staging / RECORD).write_text(json.dumps({"body": body, "signature": signature(key, body)}, sort_keys=True))
        _place(staging, folder, build, key)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _place(staging: Path, folder: Path, build: dict, key: bytes) -> None:
    for _ in range(5):
        try:
            os.rename(staging, folder)
            return
        except OSError:  # something is there: keep it if it verifies (another run built it), else replace it
            if not verify(folder, build, key):
                return
            discard(folder)
    raise NativeBuildError(f"cannot place {folder}: other runs keep replacing it")


def discard(folder: Path) -> None:
    """Remove a cached build that failed its check: renamed aside first (atomic), then deleted."""
    aside = folder.parent / f".{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.old"
    try:
        os.rename(folder, aside)
    except OSError:
        return
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)
