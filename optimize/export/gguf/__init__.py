"""A causal LM written as one GGUF file, the format llama.cpp, Ollama and LM Studio run as it is.

The file holds the tokenizer (byte-level BPE: vocabulary, merges, token types, special ids), the chat
template and the architecture's hyperparameters under the keys llama.cpp's converter writes, and the
weights in the types laptop users choose: Q8_0, Q4_0, and the K-quant mixes Q4_K_M / Q5_K_M / Q6_K,
each tensor's type picked by llama.cpp's rules (mixes.py), K-quants rounded with an importance matrix
from calibration text where one is given (imatrix.py). An Ollama Modelfile is written beside it
(modelfile.py).

    python -m optimize.export.gguf MODEL_DIR OUT.gguf --type Q4_K_M [--calibration-text FILE]
"""

from __future__ import annotations


class ExportError(ValueError):
    """A model, type or tokenizer the writer cannot write; its text is the one line to show."""


# The file types written (llama.cpp's names), most bits first.
FILE_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")
# transformers model_type -> the GGUF architecture written.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}


def check_file_type(file_type: str) -> str:
    if file_type not in FILE_TYPES:
        raise ExportError(f"GGUF type {file_type!r} cannot be written (written: {', '.join(FILE_TYPES)})")
    return file_type
