"""`python -m optimize.publish ARTIFACT --to mlflow|hf_hub [options]`: send an artifact to a model registry.

Exit 0 when it was published (one line says where; a dry run lists the files), 2 when it was refused
with nothing published: no such artifact, a tampered one (optimize.verify's checks), a failed gate
without --allow-failed, an unreachable registry or a missing setting (one line `error: ...`).
"""

from __future__ import annotations

import sys

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
        "--tracking-uri", help="mlflow: any MLflow tracking URI (default: SQLite store beside the artifact)"
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
    from optimize.publish import publish

    try:
        print(publish(artifact, settings))
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_PASSED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
