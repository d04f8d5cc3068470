"""The two runner interfaces every engine's runner meets, written down.

- TensorRunner: called on a batch of named numpy arrays, returns named numpy arrays (an encoder,
  a classifier, any ONNX graph: ONNX Runtime, OpenVINO, TensorRT-RTX, the PyTorch baseline).
- CausalLMRunner: a TensorRunner over {"input_ids"} -> {"logits"} that also scores token ids
  (perplexity, lm-eval) and times greedy generation (ONNX Runtime GenAI, OpenVINO GenAI, PyTorch's
  TorchLM, torch-cuda). TimedGeneration is the part the timing needs alone: RunnerProcess offers
  only it, running an LM runner's timed_stream in a process of its own.

They are Protocols: a runner meets one by having its members, without inheriting from it.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np


class TensorRunner(Protocol):
    input_names: list[str]
    output_names: list[str]

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


@runtime_checkable  # serve checks that an encoder's runner is one (isinstance)
class DescribedRunner(TensorRunner, Protocol):
    """A TensorRunner that describes its tensors (ONNX Runtime, OpenVINO): each input's and output's
    name, ONNX type ("tensor(float)") and shape (ints, or names of open dimensions)."""

    def signature(self) -> list[dict]: ...

    def output_signature(self) -> list[dict]: ...


class TimedGeneration(Protocol):
    def timed_stream(self, prompt_ids: Sequence[int], new_tokens: int) -> list[float]:
        """Greedy generation of exactly new_tokens: time.perf_counter() at each new token."""
        ...


class CausalLMRunner(TensorRunner, TimedGeneration, Protocol):
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab] of one token sequence, scored without a KV cache."""
        ...

    def log_likelihood(self, ids: Sequence[int], start: int = 1) -> np.ndarray:
        """Log-probability of each token ids[start:] given the tokens before it."""
        ...
