"""`python -m optimize.publish ARTIFACT --to mlflow|hf_hub [options]`: send an artifact to a model registry.

Exit 0 when it was published (one line says where, and whether the manifest was signed; a dry run lists
the files), 2 when it was refused with nothing published: no such artifact, a tampered one
(optimize.verify's checks), a bad or (with --require-signature) missing signature, a failed gate without
--allow-failed, an unreachable registry or a missing setting (one line `error: ...`).
"""

from __future__ import annotations

import sys

from engines.artifact import VERIFY_KEY_ENV
from optimize import EXIT_BAD_INPUT, EXIT_PASSED
from optimize.errors import ArgumentParser, RecipeError


def parse(argv: list[str]) -> tuple[str, dict]:
    from optimize.config import PublishConfig
    from optimize.publish import TARGETS

    defaults = PublishConfig()
    parser = ArgumentParser(prog="python -m optimize.publish")
    parser.add_argument("artifact")
    parser.add_argument("--to", required=True, choices=sorted(TARGETS), help="the registry")
    parser.add_argument("--allow-failed", action="store_true", help="publish a failed gate too, tagged failed")
    parser.add_argument(
        "--key",
        help=f"file holding the HMAC-SHA256 secret the manifest was signed with "
        f"(default: the file {VERIFY_KEY_ENV} names)",
    )
    parser.add_argument(
        "--require-signature", action="store_true", help="refuse an unsigned manifest (and one with no key to check)"
    )
    parser.add_argument(
        "--tracking-uri",
        help="mlflow: any MLflow tracking URI (default: MLFLOW_TRACKING_URI, else a SQLite store beside the artifact)",
    )
    parser.add_argument("--experiment", default=defaults.experiment, help="mlflow: the experiment")
    parser.add_argument("--model-name", help="mlflow: the registered model (default: the recipe's name)")
    parser.add_argument("--repo-id", help="hf_hub: the repository, owner/name")
    parser.add_argument("--folder", help="hf_hub: assemble the upload here and keep it (default: a temporary one)")
    parser.add_argument("--public", action="store_true", help="hf_hub: create the repository public")
    parser.add_argument("--dry-run", action="store_true", help="hf_hub: list what would be uploaded, no network")
    args = parser.parse_args(argv)
    settings = {
        "to": args.to,
        "allow_failed": args.allow_failed,
        "key": args.key,
        "require_signature": args.require_signature,
        "tracking_uri": args.tracking_uri,
        "experiment": args.experiment,
        "model_name": args.model_name,
        "repo_id": args.repo_id,
        "folder": args.folder,
        "private": not args.public,
        "dry_run": args.dry_run,
    }
    return args.artifact, settings


def main(argv: list[str]) -> int:
    artifact, settings = parse(argv)
    from optimize.publish import one_line, publish

    try:
        print(publish(artifact, settings))
    except RecipeError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_PASSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
