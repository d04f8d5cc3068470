"""Random data, only when a recipe names the `random` source (the manifest then records random: true).

Never a fallback: a method that needs calibration data and gets none fails instead. This exists
for smoke tests of a pipeline on models without real data, where scales do not matter."""

from __future__ import annotations

import hashlib

import numpy as np

from calibration import source

_WORDS = ("the", "model", "data", "value", "function", "returns", "a", "list", "of", "numbers", "and", "text")


@source("random")
def random_items(split: str, count: int = 64, seed: int = 0, shape: list | None = None, **_) -> list:
    """`count` standard-normal float32 arrays of `shape`, or (without a shape) sentences of random words.
    Each split gets its own stream, so calibration and evaluation items differ."""
    stream = int.from_bytes(hashlib.sha256(split.encode()).digest()[:4], "little")
    rng = np.random.default_rng([seed, stream])
    if shape:
        return [rng.standard_normal(list(shape)).astype(np.float32) for _ in range(count)]
    return [" ".join(rng.choice(_WORDS, size=int(rng.integers(8, 40)))) for _ in range(count)]
