"""The cache key is a secret: a key file that group or others can read or write, that another user owns,
or that sits inside the cache it signs is refused in one line (as ssh refuses such a private key), by
the race's and the GGUF conversion's cache (optimize/cache_store.py) and by the pipeline (exit 2)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines.cache import CacheKeyError
from optimize import cache_store

SECRET = "a secret of at least sixteen bytes"


@pytest.fixture
def key(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "keys" / "cache.key"
    path.parent.mkdir()
    path.write_text(SECRET)
    path.chmod(0o600)
    monkeypatch.setenv(cache_store.KEY_ENV, str(path))
    return path


def test_a_private_key_file_is_read(key):
    assert cache_store.cache_key() == SECRET.encode()


@pytest.mark.parametrize("mode", [0o666, 0o644, 0o604, 0o620])
def test_a_key_file_group_or_others_can_access_is_refused(key, tmp_path, mode):
    import json

    key.chmod(mode)
    with pytest.raises(CacheKeyError, match=f"mode {mode:04o}: group or others can access it"):
        cache_store.cache_key()
    cached = tmp_path / "cache" / "race" / "folder"
    cached.mkdir(parents=True)
    (cached / cache_store.RECORD).write_text(json.dumps({"body": {}, "signature": ""}))
    with pytest.raises(CacheKeyError):  # a cached folder is not checked against it either
        cache_store.open_verified(cached, "source")


def test_a_key_file_inside_the_cache_is_refused(tmp_path, monkeypatch):
    inside = tmp_path / "cache" / "race" / "cache.key"
    inside.parent.mkdir(parents=True)
    inside.write_text(SECRET)
    inside.chmod(0o600)
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cache_store.KEY_ENV, str(inside))
    with pytest.raises(CacheKeyError, match="inside the cache"):
        cache_store.cache_key()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_another_user_owns_is_refused(key):
    os.chown(key, 4242, 4242)
    with pytest.raises(CacheKeyError, match="owned by another user"):
        cache_store.cache_key()


def test_the_default_key_is_created_private_and_read(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv(cache_store.KEY_ENV, raising=False)
    assert len(cache_store.cache_key() or b"") == 64
    assert (tmp_path / "config" / "optimize" / "cache.key").stat().st_mode & 0o777 == 0o600


def test_the_pipeline_says_an_unsafe_key_in_one_line():
    """How the command line maps it (exit 2, the line as it is): CacheKeyError is an ArtifactError."""
    from optimize.errors import bad_input_message

    assert (
        bad_input_message(CacheKeyError("cache key file K is mode 0644: ...")) == "cache key file K is mode 0644: ..."
    )
