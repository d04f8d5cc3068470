"""The recipe's model source, read before anything else touches it: resolved, checked and loaded
(models.py), a GGUF file's header read within bounds first (gguf_header.py)."""
