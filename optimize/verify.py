"""`python -m optimize.verify ARTIFACT [--key FILE] [--require-signature]`: check an artifact (or a bundle
that `python -m optimize.export` made of one: its manifest has the same shape).

The manifest's own digest, its signature (HMAC-SHA256, with a key), that every path it names stays
inside the artifact, that every entry is a regular single-link file, and every file's sha256
(engines/artifact/, the checker serve/ uses too).

Exit 0 when the artifact is intact (and says whether its gate passed), 1 when a file is changed,
missing or unexpected, 2 when the artifact is refused: not an artifact, a malformed or edited
manifest, a path leaving the artifact, a symlink, hard link or special file, a bad or missing
signature (one line `error: ...`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import engines.artifact
from engines.artifact import VERIFY_KEY_ENV, ArtifactError, check_signature, read_key, read_manifest, verify
from optimize.errors import ArgumentParser


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m optimize.verify")
    parser.add_argument("artifact")
    parser.add_argument(
        "--key",
        help=f"file holding the HMAC-SHA256 secret the manifest was signed with "
        f"(default: the file {VERIFY_KEY_ENV} names)",
    )
    parser.add_argument("--require-signature", action="store_true", help="refuse an unsigned manifest")
    args = parser.parse_args(argv)
    try:
        key_file = args.key or os.environ.get(VERIFY_KEY_ENV)
        key = read_key(key_file) if key_file else None
        manifest = read_manifest(args.artifact)
        signed = check_signature(manifest, key, args.require_signature)
        problems = verify(args.artifact, key, args.require_signature)
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {args.artifact}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.artifact}: {len(problems)} problem(s); the artifact does not match its manifest")
        return 1
    bundle = manifest.get("bundle")
    made_from = f"; a bundle of artifact {bundle.get('source_id')}" if isinstance(bundle, dict) else ""
    print(
        f"{args.artifact}: {len(manifest['files'])} files match the manifest; "
        f"gate {manifest.get('verdict', 'unknown')}; manifest {signed}{made_from}"
    )
    if isinstance(bundle, dict) and not same_checker(Path(args.artifact)):
        print(
            f"{args.artifact}: note: its artifact/ is not this project's checker (a bundle made by another "
            "version, or its checker was replaced); only this check, not run.py's own, is independent of the bundle"
        )
    return 0


def same_checker(bundle: Path) -> bool:
    """Whether a bundle's artifact/ is this project's checker package, file for file and byte for byte.
    run.py checks the bundle with that copy where the project is not installed, and a copy cannot vouch
    for itself."""
    ours, theirs = Path(engines.artifact.__file__).parent, bundle / "artifact"
    try:
        names = sorted(path.name for path in theirs.iterdir())
        return names == sorted(path.name for path in ours.glob("*.py")) and all(
            (theirs / name).read_bytes() == (ours / name).read_bytes() for name in names
        )
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
