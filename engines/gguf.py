"""A GGUF file's tensors as every runtime that carries its blocks sees them (OpenVINO GenAI, ONNX Runtime
GenAI, the native engine): the file opened with the `gguf` package's reader, each tensor's name, type
and shape checked to fill whole blocks, the tensors an engine cannot carry named in one line, and the
manifest's summary of what each type became in that engine.

The file itself is read within bounds first, by the pipeline (optimize/sources/gguf_header.py), before
anything here opens it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VECTOR_TYPES = ("F32", "F16")  # norms and biases: copied as they are


class CarryError(RuntimeError):
    """The GGUF file cannot be carried through as it is (a type, an architecture, a malformed tensor)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: str
    shape: tuple[int, ...]  # ggml order: the row length first


def open_reader(path: Path):
    """The `gguf` package's reader on the file; CarryError (one line) for a file it cannot read."""
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OSError) as exc:  # an unknown type enum, a short file
        raise CarryError(
            f"{path.name} is not a GGUF file the readers know ({str(exc).splitlines()[0][:160]})"
        ) from None


def tensors(path: Path) -> tuple[str, list[GGUFTensor]]:
    """The file's architecture and tensors; CarryError for a tensor whose data does not fill whole
    blocks of its type (a block count that does not match its shape)."""
    import gguf

    reader = open_reader(path)
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field else ""
    out = []
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(t.tensor_type)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        shape = tuple(int(n) for n in t.shape)
        if shape[0] % block or t.data.nbytes != int(np.prod(shape)) // block * size:
            raise CarryError(
                f"GGUF tensor {t.name} ({kind.name}, shape {list(shape)}): its {t.data.nbytes} bytes are not "
                f"whole {kind.name} blocks of {block} values for that shape"
            )
        out.append(GGUFTensor(t.name, kind.name, shape))
    return architecture, out


def outside(
    items: list[GGUFTensor],
    carried: Collection[str],
    vector_types: Collection[str] = VECTOR_TYPES,
    matrices: Callable[[GGUFTensor], bool] = lambda t: True,
) -> list[GGUFTensor]:
    """The tensors an engine cannot carry: matrices (of those `matrices` picks) of a type not in `carried`,
    vectors (norms, biases) of one not in `vector_types`."""
    bad = [t for t in items if len(t.shape) >= 2 and matrices(t) and t.type not in carried]
    return bad + [t for t in items if len(t.shape) < 2 and t.type not in vector_types]


def named(bad: list[GGUFTensor]) -> str:
    """'name (type), ...' of the first six, and how many more; '' for none."""
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    return ", ".join(f"{t.name} ({t.type})" for t in bad[:6]) + more if bad else ""


def type_summary(items: list[GGUFTensor], became: Mapping[str, str]) -> dict:
    """{gguf type: {count, became, tensors}}: the manifest's record of the weights as in the source.
    `became`: what each type became in the engine (a type it does not name stays as stored)."""
    out: dict[str, dict] = {}
    for t in items:
        entry = out.setdefault(
            t.type, {"count": 0, "became": became.get(t.type, f"{t.type} (as stored)"), "tensors": []}
        )
        entry["count"] += 1
        entry["tensors"].append(t.name)
    return out
