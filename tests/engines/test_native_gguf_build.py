"""The compiled kernels are cache content, so untrusted: the library is loaded only when its sealed record
(its sha256 and build key, HMAC-signed with the cache key kept outside the cache) verifies, through the
very descriptor it is loaded from; a swapped library is removed and rebuilt, never run. A compiler or a
cache folder that cannot be used is one line (NativeBuildError), never a traceback."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from engines.native_gguf import build

needs_kernels = pytest.mark.skipif(build.unavailable() is not None, reason=f"{build.unavailable()}")
# A library whose constructor leaves a mark: what a swapped .so runs the moment it is loaded.
CONSTRUCTOR = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  FILE *f = fopen(getenv("PLANTED_MARK"), "w"); if (f) { fputs("ran", f); fclose(f); }
}
int ng_vnni(void) { return 7; }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("OPTIMIZE_CACHE_KEY", raising=False)
    monkeypatch.delenv(build.SANITIZE_ENV, raising=False)
    monkeypatch.setenv("PLANTED_MARK", str(tmp_path / "planted"))
    return tmp_path / "cache"


def _planted(tmp_path: Path) -> bytes:
    source = tmp_path / "planted.c"
    source.write_text(CONSTRUCTOR)
    out = tmp_path / "planted.so"
    subprocess.run([*build.compiler(), "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
    return out.read_bytes()


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
@needs_kernels
def test_a_swapped_library_is_removed_and_rebuilt_never_loaded(cache, tmp_path, caplog):
    library = build.library()
    record = json.loads((library.parent / build.RECORD).read_text())
    assert record["body"]["library_sha256"] and record["body"]["build"]["flags"][-1].startswith("-march=")
    library.unlink()
    library.write_bytes(_planted(tmp_path))
    with caplog.at_level(logging.WARNING):
        lib = build.load()
    assert lib.ng_vnni() in (0, 1) and not (tmp_path / "planted").exists()
    assert "the library differs from the one its record names" in caplog.text


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
@needs_kernels
def test_a_record_rewritten_to_match_a_swapped_library_fails_its_signature(cache, tmp_path, caplog):
    import hashlib

    library = build.library()
    planted = _planted(tmp_path)
    library.unlink()
    library.write_bytes(planted)
    path = library.parent / build.RECORD
    record = json.loads(path.read_text())
    record["body"]["library_sha256"] = hashlib.sha256(planted).hexdigest()  # all a forger without the key can do
    path.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING):
        assert build.load().ng_vnni() in (0, 1)
    assert not (tmp_path / "planted").exists() and "not signed with this machine's cache key" in caplog.text


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
@needs_kernels
def test_a_library_without_a_record_or_with_an_extra_file_is_rebuilt(cache, tmp_path, caplog):
    library = build.library()
    (library.parent / build.RECORD).unlink()
    with caplog.at_level(logging.WARNING):
        library = build.library()
    assert "it has no build record" in caplog.text
    (library.parent / "other.so").write_bytes(b"x")
    with caplog.at_level(logging.WARNING):
        build.library()
    assert "other files" in caplog.text and not (library.parent / "other.so").exists()


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
@needs_kernels
def test_a_library_sealed_under_another_key_is_rebuilt(cache, tmp_path, monkeypatch, caplog):
    library = build.library()
    other = tmp_path / "other.key"
    other.write_text("another secret of enough bytes")
    other.chmod(0o600)
    monkeypatch.setenv("OPTIMIZE_CACHE_KEY", str(other))
    with caplog.at_level(logging.WARNING):
        assert build.library() == library
    assert "not signed with this machine's cache key" in caplog.text


@pytest.mark.slow  # compiles, trains or loads a model: not a unit test
@needs_kernels
def test_a_sanitized_build_is_cached_under_its_own_key(cache):
    plain = build.library()
    checked = build.library(sanitize="address,undefined")
    assert plain != checked and "-fsanitize=address,undefined" in (checked.parent / build.RECORD).read_text()
    with pytest.raises(build.NativeBuildError, match="comma-separated"):
        build.library(sanitize="address; rm -rf /")


@needs_kernels
def test_cc_with_arguments_is_split_as_make_splits_it(cache, monkeypatch):
    """CC="gcc -O0" (make runs $(CC) through a shell): the compiler and its arguments, in the build key."""
    monkeypatch.setenv("CC", f"{build.compiler()[0]} -O0")
    library = build.library()
    assert "-O0" in json.loads((library.parent / build.RECORD).read_text())["body"]["build"]["compiler"]


@pytest.mark.parametrize("cc", ["folder", "/nonexistent/bin/gcc", "'unbalanced"])
def test_a_cc_that_is_no_compiler_is_one_line(cache, tmp_path, monkeypatch, cc):
    (tmp_path / "folder").mkdir()
    monkeypatch.setenv("CC", str(tmp_path / cc) if cc == "folder" else cc)
    with pytest.raises(build.NativeBuildError) as caught:
        build.compiler()
    assert "$CC=" in str(caught.value) and "\n" not in str(caught.value)
    assert build.unavailable() == str(caught.value) or build.unsupported_cpu()


@needs_kernels
def test_an_optimize_cache_that_is_a_file_is_one_line(cache, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "file"))
    with pytest.raises(build.NativeBuildError, match="cannot use the cache folder"):
        build.library()


@needs_kernels
@pytest.mark.parametrize("mode", [0o666, 0o644, 0o640])
def test_an_unsafe_cache_key_fails_the_build_in_one_line(cache, tmp_path, monkeypatch, mode):
    key = tmp_path / "cache.key"
    key.write_text("a secret of at least sixteen bytes")
    key.chmod(mode)
    monkeypatch.setenv("OPTIMIZE_CACHE_KEY", str(key))
    with pytest.raises(build.NativeBuildError, match=f"mode {mode:04o}: group or others can access it"):
        build.library()


def test_one_key_reading_and_one_signature_for_every_cache():
    """optimize/cache_store.py uses the engines' implementation, not a copy of it."""
    from engines import cache as engine_cache
    from optimize import cache_store

    assert cache_store.cache_key is engine_cache.cache_key and cache_store._signature is engine_cache.signature
    assert cache_store.KEY_ENV == engine_cache.KEY_ENV == "OPTIMIZE_CACHE_KEY"


@needs_kernels
def test_the_library_loaded_is_the_one_checked_through_its_descriptor(cache):
    """Loaded from /proc/self/fd of the descriptor it was hashed through: a rename over the path after
    the check does not change what runs."""
    lib = build.load()
    assert lib._name.startswith("/proc/self/fd/") and os.path.basename(str(build.library())) == build.LIBRARY
