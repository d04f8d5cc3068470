"""An importance matrix, as llama-imatrix computes one: for every matrix the model multiplies, the
mean over calibration tokens of each input channel's squared activation, collected with forward
hooks on the PyTorch model while it reads the calibration text (never the evaluation text). The
quantizers weigh each column's rounding error by it."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from optimize.export.gguf import ExportError


def collect(module, sequences: Iterable[list[int]]) -> dict:
    """{GGUF tensor name: float32 [input channels]} over every token of `sequences`."""
    import gguf
    import torch

    from optimize.export.gguf.writer import architecture_of

    config = module.config
    arch = architecture_of(config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def record(_module, inputs, _output):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + (x * x).sum(dim=0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return record

    handles = []
    for hf_name, child in module.named_modules():
        if not isinstance(child, torch.nn.Linear):
            continue
        if hf_name == "lm_head":
            target = "token_embd.weight" if tied else "output.weight"
        else:
            mapped = names.get_name(hf_name)
            if mapped is None:
                continue
            target = f"{mapped}.weight"
        handles.append(child.register_forward_hook(hook(target)))
    tokens = 0
    try:
        with torch.inference_mode():
            for ids in sequences:
                if len(ids) < 1:
                    continue
                module(input_ids=torch.tensor([list(ids)], dtype=torch.long))
                tokens += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    if not tokens:
        raise ExportError("the importance matrix needs calibration text: the calibration set gave no tokens")
    return {name: (sums[name] / counts[name]).cpu().numpy().astype(np.float32) for name in sums}


def save_gguf(path, means: dict, dataset: str, chunks: int, chunk_size: int) -> None:
    """The importance matrix in llama.cpp's imatrix GGUF layout (`NAME.in_sum2` and `NAME.counts`, the
    means stored with a count of 1), which llama-quantize --imatrix reads: the same rounding input for
    a comparison with llama.cpp, or for a user re-quantizing the model there."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="imatrix")
    writer.add_type("imatrix")
    writer.add_array("imatrix.datasets", [dataset])
    writer.add_uint32("imatrix.chunk_count", int(chunks))
    writer.add_uint32("imatrix.chunk_size", int(chunk_size))
    for name, values in sorted(means.items()):
        writer.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(values, dtype=np.float32))
        writer.add_tensor(f"{name}.counts", np.ones(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
