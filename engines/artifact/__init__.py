"""Reading and verifying artifact directories: the one checker `optimize.verify` and serve/ share.

An artifact is a directory with `manifest.json`. This package only reads (and seals a manifest the
pipeline is about to write, see optimize/artifact.py): serve/ must not import torch or the
pipeline, so it depends on the standard library alone. Its modules import each other relatively
only, so a bundle's run.py can load a copy of it by its path (optimize/export/bundle.py).

What is checked, before anything opens a file the manifest names:
- the manifest is a JSON object of the expected shape (a malformed one is an ArtifactError, never
  a traceback), and its `integrity.digest` is the sha256 of its own canonical JSON, so an edited
  manifest (a flipped `gate.passed`, changed metrics) is refused (manifest.py, integrity.py);
- with a key, its signature: HMAC-SHA256 over the digest (stdlib). Ed25519 is not implemented:
  the `cryptography` package is not a dependency here (integrity.py);
- every path it holds (`files[].path`, the engine's `file`/`dir`/`tokenizer`/`model_dir`) is
  relative, has no `..`, and resolves inside the artifact through no symbolic link (files.py);
- every entry on disk is a regular file with one link (symlinks, hard links, FIFOs, sockets and
  devices are refused: a symlink or a hard link lets content outside the artifact stand in for
  it, and a FIFO blocks a reader forever), and matches its recorded sha256 (files.py);
- the external-data locations of every ONNX graph (read from the protobuf here, not left to
  onnx or ONNX Runtime) are files beside the graph, inside the artifact, checked as above
  (onnx_data.py).
The manifest, and JSON from outside generally (serve/'s request bodies), is parsed strictly:
UTF-8 only, bounded integers, no lone surrogates (strict_json.py).
"""

from .errors import ArtifactError, EngineUnavailable
from .files import (
    MANIFEST,
    check_regular_file,
    check_relative,
    contained,
    describe_kind,
    file_table,
    list_files,
    sha256_file,
    walk,
)
from .integrity import (
    HMAC_SCHEME,
    INTEGRITY,
    MAX_KEY_BYTES,
    SIGNING_KEY_ENV,
    VERIFY_KEY_ENV,
    canonical,
    check_signature,
    digest_of,
    key_id,
    read_key,
    seal,
    signing_key_from_env,
)
from .manifest import (
    ENGINE_PATH_KEYS,
    MAX_MANIFEST_BYTES,
    SCHEMA_VERSION,
    check_engine_paths,
    check_shape,
    read_manifest,
    verify,
)
from .onnx_data import check_onnx_external_data, onnx_external_locations
from .strict_json import MAX_JSON_INT_DIGITS, JSONInputError, parse_json

__all__ = [
    "ENGINE_PATH_KEYS",
    "HMAC_SCHEME",
    "INTEGRITY",
    "MANIFEST",
    "MAX_JSON_INT_DIGITS",
    "MAX_KEY_BYTES",
    "MAX_MANIFEST_BYTES",
    "SCHEMA_VERSION",
    "SIGNING_KEY_ENV",
    "VERIFY_KEY_ENV",
    "ArtifactError",
    "EngineUnavailable",
    "JSONInputError",
    "canonical",
    "check_engine_paths",
    "check_onnx_external_data",
    "check_regular_file",
    "check_relative",
    "check_shape",
    "check_signature",
    "contained",
    "describe_kind",
    "digest_of",
    "file_table",
    "key_id",
    "list_files",
    "onnx_external_locations",
    "parse_json",
    "read_key",
    "read_manifest",
    "seal",
    "sha256_file",
    "signing_key_from_env",
    "verify",
    "walk",
]
