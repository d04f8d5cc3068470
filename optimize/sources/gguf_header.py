"""A GGUF file's header read within bounds, before anything else reads it.

The `gguf` package's reader (which transformers uses) materializes every metadata array element as
its own numpy view (~700 bytes each, so a 99-byte file declaring 2**62 elements never ends), recurses
into nested arrays, and transformers then builds the model its metadata describes, defaults filled in.
So the header is parsed here first, every count checked against the bytes left in the file before
it is walked, nesting and totals capped; then the model the metadata describes is checked against
sane maxima, the tensors the file really holds and this machine's memory. A file that fails is one
RecipeError naming why (exit 2); nothing is allocated in proportion to what a file claims.

`python -m optimize.sources.gguf_header FILE` prints the summary, or the one line and exit 2.
"""

from __future__ import annotations

import importlib.util
import logging
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from optimize.errors import RecipeError

log = logging.getLogger(__name__)

# Value types (the GGUF spec): fixed sizes, 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_DEPTH = 3  # arrays of arrays of scalars at most; real files nest none
MAX_KEY_BYTES = 1 << 16
MAX_ARRAY_ELEMENTS = 1 << 22  # in all arrays together: the gguf reader spends ~700 bytes on each
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_ELEMENTS = 1 << 40
# Sane maxima for what transformers builds from the metadata (the largest open models stay well under).
LIMITS = {
    "block_count": 1024,
    "embedding_length": 1 << 16,
    "feed_forward_length": 1 << 18,
    "attention.head_count": 1024,
    "attention.head_count_kv": 1024,
    "context_length": 1 << 20,  # models.MAX_LENGTH_LIMIT
    "vocab_size": 1 << 20,
    "expert_count": 1024,
}
# Keys transformers defaults (to a 7B model's values) when absent: required where its mapping reads them.
REQUIRED = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


@dataclass
class Header:
    version: int
    metadata: dict = field(default_factory=dict)  # key -> scalar, str, or ("array", length, small values)
    tensors: dict = field(default_factory=dict)  # name -> (dims, ggml type)

    @property
    def architecture(self) -> str:
        value = self.metadata.get("general.architecture")
        if not isinstance(value, str):
            raise RecipeError("general.architecture is missing or not a string")
        return value


class _Reader:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos, self.elements = buf, size, 0, 0

    def take(self, fmt: str):
        n = struct.calcsize("<" + fmt)
        if self.pos + n > self.size:
            raise RecipeError(f"truncated at byte {self.pos}")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value[0] if len(value) == 1 else value

    def count(self, what: str, each_min: int) -> int:
        """A declared count, refused when that many items of at least `each_min` bytes cannot fit."""
        n = self.take("Q")
        if n * each_min > self.size - self.pos:
            raise RecipeError(f"{what} declares {n} entries, more than the file's {self.size} bytes hold")
        return n

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.count(what, 1)
        if limit is not None and n > limit:
            raise RecipeError(f"{what} is {n} bytes long (at most {limit})")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int, key: str, depth: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == STRING:
            return self.string(f"the value of {key}")
        if kind != ARRAY:
            raise RecipeError(f"{key} has unknown value type {kind}")
        if depth >= MAX_DEPTH:
            raise RecipeError(f"{key} nests arrays more than {MAX_DEPTH} deep")
        inner = self.take("I")
        each = struct.calcsize("<" + _SCALARS[inner]) if inner in _SCALARS else 8 if inner in (STRING, ARRAY) else 0
        if not each:
            raise RecipeError(f"{key} is an array of unknown value type {inner}")
        n = self.count(key, each)
        self.elements += n
        if self.elements > MAX_ARRAY_ELEMENTS:
            raise RecipeError(f"its metadata arrays hold over {MAX_ARRAY_ELEMENTS} elements")
        if inner in _SCALARS:  # skipped, not walked: a few kept (per-layer head counts)
            small = struct.unpack_from(f"<{n}{_SCALARS[inner]}", self.buf, self.pos) if n <= 1024 else ()
            self.pos += n * each
            return ("array", n, small)
        for _ in range(n):
            self.value(inner, key, depth + 1)
        return ("array", n, ())


def read_header(path: Path) -> Header:
    """The metadata and tensor table of the GGUF file at `path`, every count bounded by its size."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise RecipeError(f"it is {size} bytes, shorter than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(buf, size)


def _parse(buf, size: int) -> Header:
    r = _Reader(buf, size)
    if bytes(buf[:4]) != b"GGUF":
        raise RecipeError("it does not start with the GGUF magic")
    r.pos = 4
    version = r.take("I")
    if version not in (2, 3):
        raise RecipeError(f"GGUF version {version} is not read here (2 and 3 are; big-endian files are not)")
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    if n_kv * 13 > size or n_tensors * 32 > size:
        raise RecipeError(f"it declares {n_kv} metadata entries and {n_tensors} tensors, more than {size} bytes hold")
    header = Header(version)
    for _ in range(n_kv):
        key = r.string("a metadata key", MAX_KEY_BYTES)
        header.metadata[key] = r.value(r.take("I"), ascii(key[:80]), 0)  # shown quoted: no control characters
    for _ in range(n_tensors):
        name = r.string("a tensor name", MAX_KEY_BYTES)
        n_dims = r.take("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise RecipeError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = tuple(r.take("Q") for _ in range(n_dims))
        header.tensors[name] = (dims, r.take("I"), r.take("Q"))
    _check_tensors(header, r.pos, size)
    return header


def _check_tensors(header: Header, end: int, size: int) -> None:
    """Each tensor of a known type, whole blocks, inside the file's data section."""
    import gguf

    alignment = header.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or not 1 <= alignment <= 1 << 16 or alignment & (alignment - 1):
        raise RecipeError(f"general.alignment={alignment!r} is not a power of two up to 65536")
    data = -(-end // alignment) * alignment
    for name, (dims, kind, offset) in header.tensors.items():
        elements = 1
        for d in dims:
            elements *= d
        if not all(dims) or elements > MAX_TENSOR_ELEMENTS:
            raise RecipeError(f"tensor {name!r} has dimensions {list(dims)}")
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise RecipeError(f"tensor {name!r} has unknown type {kind}") from None
        if dims[0] % block:
            raise RecipeError(f"tensor {name!r}: {dims[0]} values per row is not whole blocks of {block}")
        if data + offset + elements // block * type_size > size:
            raise RecipeError(f"tensor {name!r} lies beyond the end of the file")


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_model(header: Header, mapped: set[str]) -> None:
    """The model the metadata describes is bounded: `mapped` are the keys transformers reads for this
    architecture (those it would otherwise default); values within LIMITS and consistent with the
    tensors the file holds; its FP32 weights fit this machine's memory."""
    arch = header.architecture
    values: dict[str, list[int]] = {}
    for name in LIMITS:
        raw = header.metadata.get(f"{arch}.{name}")
        if raw is None:
            if name in REQUIRED and name in mapped:
                raise RecipeError(f"its metadata has no {arch}.{name} (transformers would assume a default model)")
            continue
        found = list(raw[2]) if isinstance(raw, tuple) else [raw]
        if (isinstance(raw, tuple) and len(found) != raw[1]) or not found:
            raise RecipeError(f"{arch}.{name} is an array of {raw[1]} values (at most 1024)")
        low = 0 if isinstance(raw, tuple) else 1  # per-layer arrays: 0 for a layer without attention
        for v in found:
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= LIMITS[name]:
                raise RecipeError(f"{arch}.{name}={v!r} is out of range (1 to {LIMITS[name]})")
        if max(found) < 1:
            raise RecipeError(f"{arch}.{name} is 0 for every layer")
        values[name] = found
    blocks = {int(m.group(1)) for m in map(re.compile(r"blk\.(\d+)\.").match, header.tensors) if m}
    if "block_count" in values and blocks and values["block_count"][0] != max(blocks) + 1:
        count = values["block_count"][0]
        raise RecipeError(f"{arch}.block_count={count} but it holds tensors of {max(blocks) + 1} blocks")
    embd = header.tensors.get("token_embd.weight")
    if "embedding_length" in values and embd and values["embedding_length"][0] != embd[0][0]:
        raise RecipeError(
            f"{arch}.embedding_length={values['embedding_length'][0]} but token_embd.weight has rows of {embd[0][0]}"
        )
    unexpected = _unknown_tensors(header, arch, values.get("block_count", [0])[0])
    if unexpected:
        more = f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else ""
        raise RecipeError(
            f"it holds {len(unexpected)} tensor(s) a {arch} model has not "
            f"({', '.join(map(ascii, unexpected[:5]))}{more}); "
            "transformers would drop them"
        )
    _check_memory(header, values)


def _unknown_tensors(header: Header, arch: str, blocks: int) -> list[str]:
    """The file's tensors that llama.cpp's tensor table for `arch` does not name (none when the gguf
    package does not know the architecture): transformers drops them without a word."""
    import gguf

    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch)
    if model_arch is None:
        return []
    known = set()
    for tensor in gguf.MODEL_TENSORS.get(model_arch, ()):
        pattern = gguf.TENSOR_NAMES[tensor]
        known |= {pattern.format(bid=i) for i in range(blocks)} if "{bid}" in pattern else {pattern}
    return sorted(n for n in header.tensors if n not in known and n.rsplit(".", 1)[0] not in known)


def fp32_bytes(header: Header, values: dict[str, list[int]] | None = None) -> int:
    """The model's weights in FP32: the larger of what its metadata configures (estimated) and the
    tensors the file holds."""
    values = values if values is not None else _configured(header)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    vocab = max(values.get("vocab_size", [0])[0], tokens[1] if isinstance(tokens, tuple) else 0)
    layers, width = values.get("block_count", [1])[0], values.get("embedding_length", [1])[0]
    ffn = max(values.get("feed_forward_length", [4 * width]))
    experts = values.get("expert_count", [1])[0]
    configured = layers * (4 * width * width + 3 * width * ffn * experts) + 2 * vocab * width
    held = sum(_elements(dims) for dims, _, _ in header.tensors.values())
    return 4 * max(configured, held)


def _configured(header: Header) -> dict[str, list[int]]:
    arch = header.architecture
    found = {}
    for name in LIMITS:
        raw = header.metadata.get(f"{arch}.{name}")
        if isinstance(raw, int) and not isinstance(raw, bool):
            found[name] = [raw]
        elif isinstance(raw, tuple) and raw[2]:
            found[name] = [v for v in raw[2] if isinstance(v, int)] or [0]
    return found


def _check_memory(header: Header, values: dict[str, list[int]]) -> None:
    """The file is converted a tensor at a time (optimize/sources/gguf_convert.py) and its FP32 conversion
    memory-mapped as the baseline, which every forward reads whole: it must fit this machine's memory."""
    need, have = fp32_bytes(header, values), _physical_memory()
    if need > have:
        raise RecipeError(
            f"the model it describes is {need / 2**30:.1f} GiB in FP32 (the baseline every candidate is scored "
            f"against), more than this machine's {have / 2**30:.1f} GiB of memory"
        )


def carried(header: Header) -> str:
    """One line saying what the file is and how it is carried: its architecture, layers and tensor
    types (with counts), and the FP32 conversion the baseline and the builders read."""
    import gguf

    counts: dict[str, int] = {}
    for _, kind, _ in header.tensors.values():
        name = gguf.GGMLQuantizationType(kind).name
        counts[name] = counts.get(name, 0) + 1
    types = ", ".join(f"{n} x{c}" for n, c in sorted(counts.items(), key=lambda item: -item[1]))
    layers = header.metadata.get(f"{header.architecture}.block_count")
    held = sum(_elements(dims) for dims, _, _ in header.tensors.values())
    return (
        f"GGUF {header.architecture}, {layers} layers, tensors {types}: carried (dequantized a tensor at a "
        f"time to {_size(4 * held)} of FP32 safetensors, memory-mapped as the baseline)"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _elements(dims: tuple) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


# GGUF architectures transformers reads but that are not causal LMs (encoder-decoders).
GGUF_NOT_CAUSAL = {"t5", "t5encoder", "umt5"}


def gguf_architectures() -> set[str]:
    """The GGUF `general.architecture` values the installed transformers loads (its two loaders)."""
    names: set[str] = set()
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names |= set(GGUF_SUPPORTED_ARCHITECTURES)
    except ImportError:
        pass
    try:
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    except ImportError:
        pass
    # llama.cpp's names for what transformers calls qwen2_moe, qwen3_moe, gpt_oss, minimax_m2
    aliases = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "minimax_m2": "minimax-m2"}
    names -= {"general", "tokenizer"}  # keys of transformers' GGUF config mapping, not architectures
    return names | {aliases[n] for n in names if n in aliases}


def check_gguf_source(path: Path, source: str):
    """A GGUF file transformers can load as a causal LM, or one RecipeError naming why not: its header
    is read within bounds (optimize/sources/gguf_header.py, no weights) for the architecture, the model its
    metadata describes and the tensor types, before anything loads. Returns the header."""
    if importlib.util.find_spec("gguf") is None:
        return None  # the loader says which package is missing
    import gguf
    import numpy as np

    try:
        header = read_header(path)
        architecture = header.architecture
    except (RecipeError, OSError) as exc:
        raise RecipeError(f"model.source={source} is not a readable GGUF file ({str(exc)[:200]})") from None
    from importlib.metadata import version

    known = gguf_architectures()
    if architecture not in known or architecture in GGUF_NOT_CAUSAL:
        loads = ", ".join(sorted(known - GGUF_NOT_CAUSAL))
        raise RecipeError(
            f"model.source={source}: GGUF architecture {architecture!r} is not a causal LM that "
            f"transformers {version('transformers')} loads (it loads {loads})"
        )
    try:
        check_model(header, gguf_config_keys(architecture))
    except RecipeError as exc:
        raise RecipeError(f"model.source={source}: {exc}") from None
    for kind in sorted({gguf.GGMLQuantizationType(t[1]) for t in header.tensors.values()}):
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue
        block, size = gguf.GGML_QUANT_SIZES[kind]
        try:  # one block of zeros: whether the installed gguf package dequantizes this type
            gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), kind)
        except NotImplementedError:
            raise RecipeError(
                f"model.source={source} holds {kind.name} tensors, which the installed gguf package cannot dequantize"
            ) from None
    line = f"model.source={source}: {carried(header)}"
    if line not in _SAID:  # the plan, the memory plan and the load each resolve the source: said once
        _SAID.add(line)
        log.info("%s", line)
    return header


_SAID: set[str] = set()


def gguf_config_keys(architecture: str) -> set[str]:
    """The metadata keys transformers reads into the config of a GGUF of `architecture` (without the
    architecture's prefix); the two every architecture has when its mapping is not found."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError:
        return {"block_count", "embedding_length"}
    names = {architecture, architecture.replace("-", "_"), architecture.replace("moe", "_moe")}
    found = [dict(GGUF_CONFIG_MAPPING[n]) for n in names if n in GGUF_CONFIG_MAPPING]  # type: ignore[call-overload]
    return {str(k) for k in found[0]} if found else {"block_count", "embedding_length"}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m optimize.sources.gguf_header FILE.gguf", file=sys.stderr)
        return 2
    try:
        header = check_gguf_source(Path(argv[0]), argv[0])
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(carried(header))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
