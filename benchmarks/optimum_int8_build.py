"""Build Optimum's ONNX Runtime INT8 peer: plain export, then ORTQuantizer dynamic INT8 per-channel.

Runs in a separate virtual environment that has Optimum (`optimum-onnx[onnxruntime]`): Optimum
pins an older transformers than the project uses, so it cannot share the project's venv. Imports
nothing from the project. Prints one JSON line: the quantized model's path and the versions used.

    SIDE_VENV/bin/python benchmarks/optimum_int8_build.py MODEL_DIR OUT_DIR ISA
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path


def build(model_dir: str, out: Path, isa: str) -> Path:
    from optimum.exporters.onnx import main_export
    from optimum.onnxruntime import ORTQuantizer
    from optimum.onnxruntime.configuration import AutoQuantizationConfig

    exported = out / "export"
    # Optimum's exporter validates the export against PyTorch (atol) before returning.
    main_export(model_dir, exported, task="feature-extraction", library_name="transformers")
    config = getattr(AutoQuantizationConfig, isa)(is_static=False, per_channel=True)
    quantizer = ORTQuantizer.from_pretrained(exported, file_name="model.onnx")
    saved = quantizer.quantize(quantization_config=config, save_dir=out / "quantized")
    return Path(saved) / "model_quantized.onnx"


def versions() -> dict[str, str]:
    found = {}
    for name in ("optimum", "optimum-onnx", "transformers", "torch", "onnxruntime", "onnx"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def main() -> None:
    model_dir, out, isa = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    path = build(model_dir, out, isa)
    print(json.dumps({"model": str(path), "isa": isa, "versions": versions()}))


if __name__ == "__main__":
    main()
