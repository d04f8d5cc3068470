"""One stand-in for optimize.context.Context: the same attributes and methods, without a recipe,
a dataset download or a tokenizer folder. Each test builds it with what its method reads:

    FakeContext.for_torch(teacher, tmp_path, prune_params)   # prune and distill on a tiny BERT/Llama
    FakeContext.for_onnx(tmp_path, count=32, width=64)        # quantize methods on a tiny ONNX MLP
    FakeContext.for_tokenizer(folder, tmp_path)               # modelopt methods on a tiny Llama folder
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
from omegaconf import OmegaConf

from tests.support.models import TEXTS, encode


class FakeContext:
    """Mirrors optimize.context.Context: cfg, scratch, source, encoder, threads, stage_records,
    calibration(), evaluation_data(), encode(), calibration_inputs(), pooling."""

    def __init__(
        self,
        scratch: Path,
        *,
        cfg: dict | None = None,
        source: Any = None,
        encoder: Callable | None = encode,
        items: list | None = None,
        threads: int = 1,
        pooling: dict | None = None,
    ):
        self.cfg = OmegaConf.create(cfg or {})
        self.scratch = Path(scratch)
        self.source = source
        self.encoder = encoder
        self.threads = threads
        self.stage_records: dict = {}
        self.items = list(TEXTS if items is None else items)
        self._pooling = pooling or {"mode": "mean", "normalize": False}

    @classmethod
    def for_torch(cls, teacher, scratch: Path, prune_params: dict | None = None) -> "FakeContext":
        """A source PyTorch module (the teacher), the stand-in tokenizer, and a structured-prune recipe."""
        source = SimpleNamespace(
            module=teacher, location=str(Path(scratch) / "teacher"), tokenizer_dir=None, kind="hf", gguf_file=None
        )
        return cls(scratch, source=source, cfg={"prune": {"method": "structured", "params": prune_params or {}}})

    @classmethod
    def for_onnx(cls, scratch: Path, count: int = 32, width: int = 64) -> "FakeContext":
        """Calibration items that are float vectors, encoded as the input `x` of a [batch, width] model."""
        items = [np.random.default_rng(i).standard_normal(width).astype(np.float32) for i in range(count)]
        return cls(scratch, items=items, encoder=lambda rows: {"x": np.stack(rows)})

    @classmethod
    def for_tokenizer(cls, folder: Path, scratch: Path, max_length: int = 128, count: int = 4) -> "FakeContext":
        """A real tokenizer folder and a few paragraphs of CPython's docs as calibration text."""
        import calibration
        from engines.text import TextEncoder

        return cls(
            scratch,
            encoder=TextEncoder(folder, max_length),
            items=calibration.load("cpython_docs", "calibration", count, 0).items,
        )

    def calibration(self):
        return SimpleNamespace(items=self.items, describe=lambda: {"sha256": "fake", "count": len(self.items)})

    def evaluation_data(self):
        return self.calibration()

    def encode(self, texts: list) -> dict[str, np.ndarray]:
        if self.encoder is None:
            raise AssertionError("this FakeContext has no encoder")
        return self.encoder(texts)

    def calibration_inputs(self, count: int) -> dict[str, np.ndarray]:
        return self.encode(self.calibration().items[:count])

    @property
    def pooling(self) -> dict:
        return self._pooling

    def progress(self, items, label: str):
        yield from items
