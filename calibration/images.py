"""Image sources with real labels: scikit-learn's digits (1,797 8x8 images, 10 classes, ships with
scikit-learn, so it works offline). Images are split by a hash of their pixels, so an image (or an
exact duplicate of it) is never in both splits."""

from __future__ import annotations

import numpy as np

from calibration import Labeled, _in_split, source


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All digits images as float32 [N, 8, 8] with pixel values 0..16, and their int64 labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)


@source("digits")
def digits(split: str, **_) -> Labeled:
    """scikit-learn digits; the calibration split doubles as the training split of the digits CNN."""
    images, labels = digits_arrays()
    keep = [i for i in range(len(images)) if _in_split(images[i], split)]
    return Labeled([images[i] for i in keep], [int(labels[i]) for i in keep])
