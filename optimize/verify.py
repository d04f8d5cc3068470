"""`python -m optimize.verify ARTIFACT`: check every file against the manifest's sha256.

Exit 0 when the artifact is intact (and says whether its gate passed), 1 when a file is changed,
missing or unexpected, 2 when the path is not an artifact.
"""
from __future__ import annotations

import sys

from engines.artifact import ArtifactError, read_manifest, verify


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m optimize.verify ARTIFACT_DIR", file=sys.stderr)
        return 2
    try:
        manifest = read_manifest(argv[0])
        problems = verify(argv[0])
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem)
    if problems:
        print(f"{argv[0]}: {len(problems)} problem(s); the artifact does not match its manifest")
        return 1
    print(f"{argv[0]}: {len(manifest['files'])} files match the manifest; gate {manifest.get('verdict', 'unknown')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
