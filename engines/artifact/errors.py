"""The checker's two errors: what every caller catches (ArtifactError) and its one refinement."""

from __future__ import annotations


class ArtifactError(Exception):
    """An artifact is missing, malformed, or does not match its manifest."""


class EngineUnavailable(ArtifactError):
    """The artifact is sound but this machine cannot run its engine (missing CPU feature, runtime)."""
