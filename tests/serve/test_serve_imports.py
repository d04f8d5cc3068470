"""serve/ is the minimal runtime: importing it, building the app and loading the model must not
pull in torch or the pipeline (optimize/)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.serve import ROOT

PROBE = """
import json, sys
import serve, serve.__main__, serve.app, serve.protocols.kserve, serve.protocols.openai, serve.encoder.batching
import serve.encoder.model, serve.llm.model, serve.llm.service, serve.llm.stops, serve.metrics, serve.protocols.openapi
import serve.protocols.parsing, serve.body, serve.config, serve.protocols.spec, serve.protocols.server
import serve.protocols.predict, engines.generation
import engines.onnxruntime_genai.runner
from pathlib import Path
from serve.app import create_app, load_model_for
app = create_app(Path(sys.argv[1]))
model = load_model_for(app.state.serve)
model.run_batch([model.from_texts(["hello"])])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "optimize", "transformers", "calibration"))
print(json.dumps(heavy))
"""


def test_serve_imports_neither_torch_nor_optimize(encoder_artifact):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(encoder_artifact)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
