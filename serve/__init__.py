"""serve: the minimal runtime. Loads one gated artifact and serves it over HTTP.

    python -m serve ARTIFACT [--host 127.0.0.1] [--port 8000] ...

Speaks KServe v2 / Triton HTTP (/v2/...), the OpenAI API (/v1/...), Prometheus (/metrics), and
describes itself at /openapi.json. Imports onnxruntime, tokenizers, numpy and the HTTP stack;
never torch, never the pipeline (optimize/). See serve/README.md.
"""

__version__ = "0.1.0"
