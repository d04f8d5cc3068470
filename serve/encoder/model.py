"""A sentence-embedding encoder behind the batcher: tokenize, check, pad per batch, run, split.

The Runner is the pipeline's OrtRunner with idle threads that sleep instead of spinning
(engines/onnxruntime/runner.py says why): same graph, same call, same numbers. Requests arrive
as int64 tensors [rows, sequence] (KServe clients send them; text is tokenized with the artifact's
own tokenizer through engines.text.TextEncoder). A batch is padded to its longest sequence only:
the graph mean-pools over the attention mask, so padding does not change an embedding, and
per-token outputs are cut back to each request's own length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from serve.encoder.datatypes import NUMPY_TO_KSERVE, ORT_TO_NUMPY
from serve.errors import too_large_batch, unprocessable

if TYPE_CHECKING:
    from serve.config import ServeConfig
    from serve.encoder.batching import BatchItem
    from serve.state import ServeState

# Value ranges the graph can take without failing inside ONNX Runtime (an index out of range
# would be a 500): masks and BERT segment ids are 0/1; token ids must be in the vocabulary.
BINARY_INPUTS = ("attention_mask", "token_type_ids")


@dataclass
class EncoderBatchItem:
    inputs: dict[str, np.ndarray]  # int64 [rows, sequence]

    @property
    def rows(self) -> int:
        return next(iter(self.inputs.values())).shape[0]

    @property
    def length(self) -> int:
        return next(iter(self.inputs.values())).shape[1]

    def split(self, size: int) -> list[EncoderBatchItem]:
        """Pieces of at most `size` rows, in order."""
        return [
            EncoderBatchItem({k: v[i : i + size] for k, v in self.inputs.items()}) for i in range(0, self.rows, size)
        ]


class EncoderModel:
    task = "sentence_embedding"
    ANSWERS: ClassVar[frozenset[str]] = frozenset({"tensors", "embeddings"})
    USE: ClassVar[str] = "an encoder (sentence embeddings): use /v1/embeddings"

    @classmethod
    def load(cls, root: Path, engine: dict, config: ServeConfig) -> EncoderModel:
        return cls(root, engine, config.ort_threads(), spinning=config.ort_spinning)

    def __init__(self, root: Path, engine: dict, threads: int = 0, spinning: bool = False):
        from engines import load_engine
        from engines.runners import DescribedRunner
        from engines.text import TextEncoder

        self.root = root
        self.max_length = int(engine.get("max_length") or 128)
        # Any runtime whose Runner describes its tensors (ONNX Runtime, OpenVINO): see engines/formats.py.
        runner = load_engine(root, engine, threads=threads, spinning=spinning)
        if not isinstance(runner, DescribedRunner):
            raise ValueError(
                f"engine format {engine.get('format')!r} does not describe its tensors: it cannot serve here"
            )
        self.runner: DescribedRunner = runner
        self.text = TextEncoder(root / engine.get("tokenizer", "tokenizer"), self.max_length)
        self.vocab_size = self.text.tokenizer.get_vocab_size()
        self.input_names = list(self.runner.input_names)
        self.output_names = list(self.runner.output_names)
        self.inputs_meta = self.runner.signature()
        self.outputs_meta = {o["name"]: o for o in self.runner.output_signature()}
        # The symbolic name of the inputs' sequence axis; outputs that share it are per-token.
        self.sequence_axis = self.inputs_meta[0]["shape"][1]

    # --- metadata ----------------------------------------------------------------------------------

    def tensor_metadata(self) -> tuple[list[dict], list[dict]]:
        """KServe metadata: names, datatypes and shapes (-1 for dimensions the graph leaves open)."""

        def describe(arg: dict) -> dict:
            dtype = np.dtype(ORT_TO_NUMPY.get(arg["type"], "float32"))
            shape = [d if isinstance(d, int) else -1 for d in arg["shape"]]
            return {"name": arg["name"], "datatype": NUMPY_TO_KSERVE.get(dtype, "FP32"), "shape": shape}

        return [describe(i) for i in self.inputs_meta], [describe(o) for o in self.outputs_meta.values()]

    @property
    def embedding_dim(self) -> int:
        shape = self.outputs_meta["sentence_embedding"]["shape"]
        return shape[-1] if isinstance(shape[-1], int) else -1

    # --- building batch items ----------------------------------------------------------------------

    def cut(self, texts: list[str]) -> list[str]:
        """Texts cut to what max_length tokens can hold (serve/body.py's MAX_CHARS_PER_TOKEN), before
        tokenizing: the tokenizer truncates to max_length anyway, after tokenizing all it is given."""
        from serve.body import MAX_CHARS_PER_TOKEN

        limit = self.max_length * MAX_CHARS_PER_TOKEN
        return [t if len(t) <= limit else t[:limit] for t in texts]

    def from_texts(self, texts: list[str]) -> EncoderBatchItem:
        texts = self.cut(texts)
        if len(texts) == 1:  # the common request: `encode` skips encode_batch's thread-pool hand-off
            encoding = self.text.tokenizer.encode(texts[0])
            return EncoderBatchItem(
                {
                    "input_ids": np.array([encoding.ids], dtype=np.int64),
                    "attention_mask": np.array([encoding.attention_mask], dtype=np.int64),
                    "token_type_ids": np.array([encoding.type_ids], dtype=np.int64),
                }
            )
        return EncoderBatchItem(self.text(texts))

    def from_token_ids(self, token_ids: list[list[int]]) -> EncoderBatchItem:
        """Token arrays of different lengths: right-padded, masked, segment 0."""
        length = max(len(ids) for ids in token_ids)
        if length > self.max_length:
            raise unprocessable(f"a token array has {length} tokens; this model takes at most {self.max_length}")
        ids = np.zeros((len(token_ids), length), dtype=np.int64)
        mask = np.zeros_like(ids)
        for row, tokens in enumerate(token_ids):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        item = EncoderBatchItem({"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
        self.check_ranges(item.inputs)
        return item

    def from_tensors(self, inputs: dict[str, np.ndarray]) -> EncoderBatchItem:
        """KServe tensors: exactly the graph's inputs, int64, one shared shape [rows, sequence]."""
        names = set(inputs)
        if names != set(self.input_names):
            unknown, missing = sorted(names - set(self.input_names)), sorted(set(self.input_names) - names)
            raise unprocessable(f"inputs must be {self.input_names}; unknown {unknown}, missing {missing}")
        shapes = {name: array.shape for name, array in inputs.items()}
        for name, array in inputs.items():
            if array.dtype != np.int64:
                raise unprocessable(f"input {name!r} must be INT64, got {array.dtype}")
        shape = shapes[self.input_names[0]]
        if len(shape) != 2 or any(s != shape for s in shapes.values()):
            raise unprocessable(f"inputs must share one shape [batch, sequence]; got {shapes}")
        if not (shape[0] >= 1 and 1 <= shape[1] <= self.max_length):
            raise unprocessable(f"shape {list(shape)}: need batch >= 1 and 1 <= sequence <= {self.max_length}")
        self.check_ranges(inputs)
        return EncoderBatchItem(inputs)

    def check_ranges(self, inputs: dict[str, np.ndarray]) -> None:
        ids = inputs["input_ids"]
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise unprocessable(f"token ids must be in [0, {self.vocab_size})")
        for name in BINARY_INPUTS:
            if name in inputs and not np.isin(inputs[name], (0, 1)).all():
                raise unprocessable(f"input {name!r} must hold only 0 and 1")

    # --- running a batch (in the runner thread) ------------------------------------------------------

    def run_batch(self, items: list[EncoderBatchItem]) -> list[dict[str, np.ndarray]]:
        length = max(item.length for item in items)
        feed = {
            name: np.concatenate([pad_to(item.inputs[name], length) for item in items]) for name in self.input_names
        }
        outputs = self.runner(feed)
        results, start = [], 0
        for item in items:
            rows = slice(start, start + item.rows)
            results.append({name: self.trim(name, value[rows], item.length) for name, value in outputs.items()})
            start += item.rows
        return results

    def trim(self, name: str, value: np.ndarray, length: int) -> np.ndarray:
        """Cut per-token outputs (axis 1 is the inputs' sequence axis) back to the request's own length."""
        shape = self.outputs_meta[name]["shape"]
        if len(shape) >= 2 and isinstance(shape[1], str) and shape[1] == self.sequence_axis:
            return value[:, :length]
        return value


def pad_to(array: np.ndarray, length: int) -> np.ndarray:
    """Right-pad with zeros: pad token id, attention mask 0, segment 0."""
    if array.shape[1] == length:
        return array
    return np.pad(array, ((0, 0), (0, length - array.shape[1])))


# --- a request's item through the batcher (every protocol that runs an encoder) ---------------------


async def run_encoder(state: ServeState, item: BatchItem) -> dict[str, np.ndarray]:
    """Submit to the batcher; a request larger than one batch goes in batch-sized pieces (each kind
    of item knows how it may be cut: a tensor model's request whose batch is not on axis 0 stays whole)."""
    batcher = state.ready_batcher()
    size, timeout = state.config.max_batch_size, state.config.timeout_s
    if item.rows > state.config.max_inputs:  # every route: the cap on rows per request
        raise too_large_batch(item.rows, state.config.max_inputs)
    pieces = item.split(size) if item.rows > size else [item]
    if len(pieces) == 1:
        return await batcher.submit(item, item.rows, timeout)
    # All pieces are queued or none is (429), and a refused, timed-out or abandoned request's pieces
    # leave the queue at once: none of them reaches the model.
    results = await batcher.submit_many([(p, p.rows) for p in pieces], timeout)
    return {name: np.concatenate([r[name] for r in results]) for name in results[0]}
