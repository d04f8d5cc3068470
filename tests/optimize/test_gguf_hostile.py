"""Hostile GGUF files are refused from their header, within bounded memory and time: counts against
the file's size, nesting, dimensions and tensor extents, then the model the metadata describes
(block and head counts, widths, context length) against sane maxima, the tensors the file really
holds and this machine's memory. Refused is one line and exit 2, before transformers builds anything."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from optimize.errors import RecipeError
from optimize.sources.gguf_header import Header, check_model, main, read_header

pytest.importorskip("gguf")


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", kind) + payload


def raw_gguf(kvs: list[bytes], n_tensors: int = 0, tensors: bytes = b"", n_kv: int | None = None) -> bytes:
    """A GGUF v3 file's bytes: the header, the given metadata entries and tensor infos as written."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + tensors


ARCH = _kv("general.architecture", 8, _str("llama"))


def _u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


# Files whose header alone must be refused (the parser, no transformers): name -> bytes.
HEADER_CASES = {
    # 2**62 u8 elements declared in a 99-byte file: the gguf reader's loop never ends.
    "huge array": raw_gguf([ARCH, _kv("a", 9, struct.pack("<IQ", 0, 1 << 62))]).ljust(99, b"\0"),
    # Arrays nested 5,000 deep: RecursionError in the gguf reader.
    "deep nesting": raw_gguf([ARCH, _kv("a", 9, struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 0, 0))]),
    # 10 MB of one-byte elements: ~7 GB in the gguf reader.
    "ten million elements": raw_gguf([ARCH, _kv("a", 9, struct.pack("<IQ", 0, 10_000_000) + bytes(10_000_000))]),
    "huge string": raw_gguf([_kv("general.architecture", 8, struct.pack("<Q", 1 << 60))]),
    "huge kv count": raw_gguf([ARCH], n_kv=1 << 60),
    "huge tensor count": raw_gguf([ARCH], n_tensors=1 << 60),
    "tensor past the end": raw_gguf([ARCH], 1, _str("t") + struct.pack("<IQQIQ", 2, 4096, 4096, 0, 0)),
    "five dimensions": raw_gguf([ARCH], 1, _str("t") + struct.pack("<I5QIQ", 5, 1, 1, 1, 1, 1, 0, 0)),
    "zero dimension": raw_gguf([ARCH], 1, _str("t") + struct.pack("<IQIQ", 1, 0, 0, 0)),
    "unknown tensor type": raw_gguf([ARCH], 1, _str("t") + struct.pack("<IQIQ", 1, 1, 999, 0)),
    "unknown value type": raw_gguf([_kv("a", 77, b"")]),
    "version 1": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
    "bad magic": b"GGML" + bytes(40),
    "truncated": raw_gguf([ARCH])[:-3],
}


@pytest.mark.parametrize("name", sorted(HEADER_CASES))
def test_a_hostile_header_is_refused_with_one_line(name, tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(HEADER_CASES[name])
    with pytest.raises(RecipeError) as refused:
        read_header(path)
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A real tiny Llama as a Q8_0 GGUF (tests/support/gguf_writer.py)."""
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    work = tmp_path_factory.mktemp("gguf")
    return write_gguf(tiny_llama_folder(work / "src"), work / "tiny.Q8_0.gguf", "Q8_0")


def _patched(source: Path, out: Path, key: str, value: int) -> Path:
    """`source` with the u32 metadata value of `key` replaced (in place, same layout)."""
    data = bytearray(source.read_bytes())
    at = data.index(_str(key)) + len(_str(key))
    assert struct.unpack_from("<I", data, at)[0] == 4, f"{key} is not a u32"
    struct.pack_into("<I", data, at + 4, value)
    out.write_bytes(bytes(data))
    return out


# Metadata that passes the header but describes a model transformers must not build.
MODEL_CASES = {
    "block_count 1e6": ("llama.block_count", 10**6),
    "block_count 3 of 2": ("llama.block_count", 3),
    "embedding_length 2**20": ("llama.embedding_length", 1 << 20),
    "embedding_length 48 of 64": ("llama.embedding_length", 48),
    "head_count 0": ("llama.attention.head_count", 0),
    "head_count_kv 0": ("llama.attention.head_count_kv", 0),
    "feed_forward_length 2**31": ("llama.feed_forward_length", 1 << 31),
    "context_length 2**32-1": ("llama.context_length", 2**32 - 1),
}


def _hostile_files(tiny: Path, folder: Path) -> list[Path]:
    files = []
    for i, name in enumerate(sorted(HEADER_CASES)):
        files.append(folder / f"h{i}.gguf")
        files[-1].write_bytes(HEADER_CASES[name])
    for i, (key, value) in enumerate(MODEL_CASES.values()):
        files.append(_patched(tiny, folder / f"m{i}.gguf", key, value))
    files.append(folder / "only_llama.gguf")  # a 69-byte file naming only `llama`: transformers' default 7B
    files[-1].write_bytes(raw_gguf([ARCH]).ljust(69, b"\0"))
    return files


def test_the_tiny_gguf_itself_passes(tiny_gguf, capsys):
    assert main([str(tiny_gguf)]) == 0
    assert capsys.readouterr().out.startswith("GGUF llama, 2 layers, tensors Q8_0 x")


# One process checks every hostile file as the pipeline does (check_gguf_source, which resolve() runs
# before any loading), then reports its peak resident memory.
CHECKER = """
import json, resource, sys
from pathlib import Path
from optimize.errors import RecipeError
from optimize.sources.gguf_header import check_gguf_source
lines = {}
for name in sys.argv[1:]:
    try:
        check_gguf_source(Path(name), name)
        lines[name] = None
    except RecipeError as exc:
        lines[name] = str(exc)
status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
hwm = [int(l.split()[1]) * 1024 for l in status.splitlines() if l.startswith("VmHWM:")]
peak = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"lines": lines, "peak": peak}))
"""


@pytest.mark.slow
def test_every_hostile_gguf_is_refused_in_one_line_under_1_gb(tiny_gguf, tmp_path):
    files = _hostile_files(tiny_gguf, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", CHECKER, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for name, line in result["lines"].items():
        assert line and "\n" not in line and line.startswith(f"model.source={name}"), (name, line)
    assert result["peak"] < 1 << 30, f"peak resident memory {result['peak'] / 2**20:.0f} MiB"


@pytest.mark.slow
def test_the_pipeline_refuses_a_gguf_naming_only_llama_with_exit_2(tmp_path):
    from tests.support.cli import one_error_line, run_optimize

    path = tmp_path / "only_llama.gguf"
    path.write_bytes(raw_gguf([ARCH]).ljust(69, b"\0"))
    proc = run_optimize(
        f"model.source={path}", "recipe=smollm2_int4_cpu", f"output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path}"
    )
    one_error_line(proc, "no llama.block_count")
    assert not (tmp_path / "out").exists()


def _mutations(seed: bytes, rng: random.Random):
    """Small files: the real one with bytes flipped, counts overwritten with extremes, cut short, or
    spliced; and random bytes behind a GGUF magic."""
    extremes = [0, 1, 0xFF, 0xFFFFFFFF, 1 << 31, 1 << 62, (1 << 64) - 1]
    for _ in range(300):
        data = bytearray(seed)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(min(len(data) - 8, 12_000))  # the header: tensor data is never parsed
            if rng.random() < 0.5:
                data[at] = rng.randrange(256)
            else:
                struct.pack_into("<Q", data, at, rng.choice(extremes))
        if rng.random() < 0.2:
            data = data[: rng.randrange(len(data))]
        yield bytes(data)
    for _ in range(100):
        yield (
            b"GGUF"
            + struct.pack("<I", rng.choice([2, 3]))
            + bytes(rng.randrange(256) for _ in range(rng.randrange(200)))
        )


@pytest.mark.slow
def test_fuzzed_gguf_headers_exit_0_or_2_with_one_line(tiny_gguf, tmp_path, capsys):
    rng = random.Random(35)
    path = tmp_path / "fuzz.gguf"
    for data in _mutations(tiny_gguf.read_bytes(), rng):
        path.write_bytes(data)
        code = main([str(path)])
        err = capsys.readouterr().err
        assert code in (0, 2), data[:64]
        assert code == 0 or (err.count("\n") == 1 and err.startswith("error: model.source=")), err


def _header(**metadata) -> Header:
    """A two-block llama's header as read (tensors of width 64), with `metadata` over its hparams."""
    base = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64}
    base.update({"llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.context_length": 512})
    base.update({k.replace("__", "."): v for k, v in metadata.items()})
    tensors = {"token_embd.weight": ((64, 100), 0, 0), "blk.0.attn_q.weight": ((64, 64), 0, 0)}
    tensors["blk.1.attn_q.weight"] = ((64, 64), 0, 0)
    return Header(3, {k: v for k, v in base.items() if v is not None}, tensors)


MAPPED = {"block_count", "embedding_length", "feed_forward_length", "attention.head_count", "context_length"}


def test_per_layer_head_counts_may_skip_layers_but_not_all():
    check_model(_header(llama__attention__head_count_kv=("array", 2, (0, 2))), MAPPED)
    with pytest.raises(RecipeError, match="0 for every layer"):
        check_model(_header(llama__attention__head_count_kv=("array", 2, (0, 0))), MAPPED)


def test_a_key_transformers_would_default_must_be_there():
    with pytest.raises(RecipeError, match="no llama.feed_forward_length"):
        check_model(_header(llama__feed_forward_length=None), MAPPED)
    check_model(_header(llama__feed_forward_length=None), MAPPED - {"feed_forward_length"})
