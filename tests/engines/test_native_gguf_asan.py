"""The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer, fed mutated GGUF files.

kernels.c is built with -fsanitize=address,undefined (build.py's `sanitize`, cached under its own key)
and run in a child Python with the ASan runtime preloaded (Python itself is not built with it, so
LD_PRELOAD is how the runtime comes first). Every mutation of what the kernels read — header counts
and floats, tensor shapes and types, block scales, data offsets, norms — must either be refused in
Python in one line (contract.py) or run clean: any sanitizer report, crash or other exception fails.
The mutations are an explicit list (each defect the contract closes) plus a seeded random set, of a
Llama mixing Q4_0 / Q4_1 / Q8_0, of one mixing the K-quants (Q4_K, Q5_K, Q6_K: width 256, whole
super-blocks) and of a Qwen2 (q/k/v biases, Q5_0, Q5_1 and Q5_K matrices).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines.native_gguf import build

SANITIZE = "address,undefined"
RANDOM_MUTATIONS = 150


def _libasan() -> str | None:
    """The compiler's ASan runtime, or None where it has none."""
    try:
        cc = build.compiler()
        found = subprocess.run([*cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    except (build.NativeBuildError, OSError):
        return None
    return found if os.path.isabs(found) and os.path.isfile(found) else None


def _unavailable() -> str | None:
    if any(importlib.util.find_spec(m) is None for m in ("gguf", "transformers")):
        return "needs gguf and transformers"
    if reason := build.unavailable():
        return reason
    if _libasan() is None:
        return "the C compiler here has no AddressSanitizer runtime (libasan.so)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_unavailable() is not None, reason=f"{_unavailable()}")]

# The child: load each file, run a prompt's passes and a step, say what happened as one JSON line.
CHILD = r"""
import json, sys
import numpy as np
from engines.native_gguf.model import NativeGGUF
from engines.gguf import CarryError

for path in sys.argv[1:]:
    print(json.dumps({"file": path, "outcome": "start"}), flush=True)
    try:
        model = NativeGGUF(path, context=64, threads=2)
    except CarryError as exc:  # NativeModelError, or a file the gguf reader cannot read
        print(json.dumps({"file": path, "outcome": "refused", "message": str(exc)}), flush=True)
        continue
    except Exception as exc:
        print(json.dumps({"file": path, "outcome": "error", "message": f"{type(exc).__name__}: {exc}"}), flush=True)
        continue
    n = min(20, model.context - 1, model.hyper.vocab)
    tokens = [t % model.hyper.vocab for t in range(1, n + 1)]
    if n > 0:
        model.forward(tokens, 0)
        model.step(tokens[-1], n)
    model.close()
    print(json.dumps({"file": path, "outcome": "ran"}), flush=True)
"""

# A call around the contract (a norm of 32 floats for a width of 64): the sanitizer must see it, or the
# lane proves nothing.
CANARY = r"""
import ctypes
import numpy as np
from engines.native_gguf import build
lib = build.load()
p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
lib.ng_new.restype = p
lib.ng_new.argtypes = [i, i, i, i, i, i, i, f, f, i, i, i]
lib.ng_head.argtypes = [p, p, i, p, i, p]
lib.ng_forward.argtypes = [p, p, i, i, p, i]
lib.ng_layer.argtypes = [p, i, p, p, p, p, p]
m = lib.ng_new(1, 64, 64, 2, 2, 16, 8, 10000.0, 1e-5, 1, 1, 0)
norm = np.ones(64, np.float32); short = np.ones(32, np.float32)
q = np.zeros(16 // 16 * 2 * 544 * 12, np.uint8)  # zero weights, 8-bit, enough for every matrix
kinds = (ctypes.c_int * 4)(1, 1, 1, 1); rows = (ctypes.c_int * 4)(192, 64, 128, 64)
data = (ctypes.c_void_p * 4)(*[q.ctypes.data] * 4)
lib.ng_layer(m, 0, norm.ctypes.data, norm.ctypes.data, kinds, rows, data)
lib.ng_head(m, short.ctypes.data, 1, q.ctypes.data, 1, q.ctypes.data)
logits = np.zeros((16, 16), np.float32); tokens = np.zeros(1, np.int32)
lib.ng_forward(m, tokens.ctypes.data, 1, 0, logits.ctypes.data, 1)
print("no report")
"""


def _sanitized_env(tmp_path: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "OPTIMIZE_CACHE": str(tmp_path / "cache"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        build.SANITIZE_ENV: SANITIZE,
        "LD_PRELOAD": str(_libasan()),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }


def _run_child(script: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = _sanitized_env(tmp_path)
    env.pop("OPTIMIZE_CACHE_KEY", None)
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)


SANITIZER_WORDS = ("AddressSanitizer", "runtime error:", "UndefinedBehaviorSanitizer", "LeakSanitizer")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with the cache (the sanitized build, compiled once) and the base file."""
    from tests.engines.test_native_gguf_contract import mixed
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder

    root = tmp_path_factory.mktemp("asan")
    write_gguf(tiny_llama_folder(root / "hf"), root / "base.gguf", mixed)
    return root


@pytest.fixture(scope="module")
def other_bases(work) -> list[Path]:
    """Folders beside `work`'s, each with its own base.gguf: the K-quants' Llama and the Qwen2."""
    from tests.engines.test_native_gguf import k_mixed
    from tests.support.gguf_writer import write_gguf
    from tests.support.models import tiny_llama_folder
    from tests.support.tiny_archs import tiny_folder

    k_quants, qwen2 = work / "k_quants", work / "qwen2"
    write_gguf(tiny_llama_folder(k_quants / "hf", hidden=256, ffn=512), k_quants / "base.gguf", k_mixed)
    write_gguf(tiny_folder("qwen2", qwen2 / "hf"), qwen2 / "base.gguf", qwen2_mixed)
    return [k_quants, qwen2]


def qwen2_mixed(name: str) -> str:
    """The down projection (rows of 256) Q5_K, the output projection Q5_0, gate and up Q5_1, the
    embedding Q4_1, the rest Q8_0."""
    for part, kind in (("ffn_down", "Q5_K"), ("attn_output", "Q5_0"), ("ffn_", "Q5_1"), ("token_embd", "Q4_1")):
        if part in name:
            return kind
    return "Q8_0"


def test_the_sanitizer_lane_catches_a_read_past_a_buffer(work):
    """The preloaded runtime works here: a call that skips the contract is reported and aborts."""
    proc = _run_child(CANARY, [], work)
    assert proc.returncode != 0 and "heap-buffer-overflow" in proc.stderr, proc.stderr[-3000:]


def test_every_mutated_file_is_refused_in_one_line_or_runs_clean(work):
    files = explicit_mutations(work) + random_mutations(work, RANDOM_MUTATIONS, seed=20240611)
    proc = _run_child(CHILD, [str(f) for f in [work / "base.gguf", *files]], work)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    last = next((e["file"] for e in reversed(events) if e["outcome"] == "start"), None)
    reports = [w for w in SANITIZER_WORDS if w in proc.stderr]
    assert proc.returncode == 0 and not reports, f"while running {last}:\n{proc.stderr[-4000:]}"
    outcomes = {e["file"]: e for e in events if e["outcome"] != "start"}
    assert len(outcomes) == len(files) + 1
    errors = [e for e in outcomes.values() if e["outcome"] == "error"]
    assert not errors, errors[:5]
    assert outcomes[str(work / "base.gguf")]["outcome"] == "ran"
    assert all("\n" not in e["message"] for e in outcomes.values() if e["outcome"] == "refused")
    # Each defect the contract closes is refused, not run.
    for f in files:
        if f.name.startswith("defect-"):
            assert outcomes[str(f)]["outcome"] == "refused", (f.name, outcomes[str(f)])


# The packed 5- and 6-bit kernels (Q5_0, Q5_1, Q5_K, Q6_K) on both paths: AVX-512 VNNI where the CPU has
# it, and the AVX2 one (x86-64-v3) on any CPU.
PATHS = ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(build.path() == "AVX2", reason="native is AVX2"))]


@pytest.mark.parametrize("march", PATHS)
def test_k_quant_and_qwen2_files_mutated_are_refused_in_one_line_or_run_clean(work, other_bases, march, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_NATIVE_MARCH", march)
    files = []
    for index, base in enumerate(other_bases):
        files += [base / "base.gguf", *k_and_bias_mutations(base), *random_mutations(base, 60, seed=20251206 + index)]
    proc = _run_child(CHILD, [str(f) for f in files], work)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    last = next((e["file"] for e in reversed(events) if e["outcome"] == "start"), None)
    reports = [w for w in SANITIZER_WORDS if w in proc.stderr]
    assert proc.returncode == 0 and not reports, f"while running {last}:\n{proc.stderr[-4000:]}"
    outcomes = {e["file"]: e for e in events if e["outcome"] != "start"}
    assert len(outcomes) == len(files)
    assert not [e for e in outcomes.values() if e["outcome"] == "error"]
    assert all(outcomes[str(base / "base.gguf")]["outcome"] == "ran" for base in other_bases)
    assert all("\n" not in e["message"] for e in outcomes.values() if e["outcome"] == "refused")
    for f in files:
        if f.name.startswith("defect-"):
            assert outcomes[str(f)]["outcome"] == "refused", (f.name, outcomes[str(f)])


# --- mutations --------------------------------------------------------------------------------------


def _copy(work: Path, name: str) -> Path:
    out = work / "mutated" / name
    out.parent.mkdir(exist_ok=True)
    shutil.copyfile(work / "base.gguf", out)
    return out


def _rewritten(work: Path, name: str, fields=None, tensors=None) -> Path:
    from tests.support.gguf_writer import rewrite_gguf

    out = work / "mutated" / name
    out.parent.mkdir(exist_ok=True)
    return rewrite_gguf(work / "base.gguf", out, fields=fields, tensors=tensors)


def _raw(work: Path, name: str) -> tuple[np.ndarray, object]:
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(str(work / "base.gguf")).tensors if t.name == name)
    return np.array(t.data), t.tensor_type


def _with_half(work: Path, out: str, name: str, row: int, at: int, bits: int) -> Path:
    raw, kind = _raw(work, name)
    raw[row, at : at + 2] = np.array([bits], np.uint16).view(np.uint8)
    return _rewritten(work, out, tensors={name: (raw, kind)})


def explicit_mutations(work: Path) -> list[Path]:
    """One file for each defect the contract closes (named defect-*: each must be refused)."""
    from gguf import GGMLQuantizationType, GGUFValueType, quants

    from tests.support.gguf_writer import edit_tensor_info, tensor_offsets

    f32, u64 = GGUFValueType.FLOAT32, GGUFValueType.UINT64
    q8 = GGMLQuantizationType.Q8_0
    files = [
        _rewritten(work, "defect-attn-norm-32.gguf", tensors={"blk.0.attn_norm.weight": np.ones(32, np.float32)}),
        _rewritten(work, "defect-ffn-norm-1.gguf", tensors={"blk.1.ffn_norm.weight": np.ones(1, np.float32)}),
        _rewritten(work, "defect-output-norm-f16.gguf", tensors={"output_norm.weight": np.ones(16, np.float16)}),
        _rewritten(
            work,
            "defect-norm-q8.gguf",
            tensors={"blk.0.ffn_norm.weight": (quants.quantize(np.ones((32, 64), np.float32), q8), q8)},
        ),
        _rewritten(
            work,
            "defect-embedding-rows.gguf",
            tensors={"token_embd.weight": (quants.quantize(np.ones((512, 32), np.float32), q8), q8)},
        ),
        _rewritten(
            work,
            "defect-head-shape.gguf",
            tensors={"output.weight": (quants.quantize(np.ones((256, 64), np.float32), q8), q8)},
        ),
        _rewritten(work, "defect-embedding-1d.gguf", tensors={"token_embd.weight": np.ones(512 * 64, np.float32)}),
        _rewritten(work, "defect-block-count-2.5.gguf", fields={"llama.block_count": (2.5, f32)}),
        _rewritten(work, "huge-header-context.gguf", fields={"llama.context_length": (2**32 + 16, u64)}),
    ]
    for value in (0.0, float("nan"), -10000.0):
        files.append(_rewritten(work, f"defect-rope-{value}.gguf", fields={"llama.rope.freq_base": (value, f32)}))
    for value in (0.0, -1e-5, float("nan"), float("inf")):
        key = "llama.attention.layer_norm_rms_epsilon"
        files.append(_rewritten(work, f"defect-eps-{value}.gguf", fields={key: (value, f32)}))
    for name, at in (("blk.0.ffn_down.weight", 0), ("blk.0.attn_q.weight", 0), ("blk.0.attn_q.weight", 2)):
        files.append(_with_half(work, f"defect-nan-{name}-{at}.gguf", name, 5, at, 0x7E00))
    files.append(_with_half(work, "defect-inf-q4_0.gguf", "blk.1.attn_k.weight", 0, 0, 0x7C00))
    # Numbers that are legal but extreme run clean: activations that underflow (a norm of 1e-30, an
    # epsilon of 3.4e38) quantize to zeros rather than to NaN.
    files.append(_rewritten(work, "tiny-norm.gguf", tensors={"blk.0.ffn_norm.weight": np.full(64, 1e-30, np.float32)}))
    files.append(_rewritten(work, "huge-eps.gguf", fields={"llama.attention.layer_norm_rms_epsilon": (3.4e38, f32)}))
    # The largest f16 scale on V's rows: values beyond f16's range saturate in the f16 KV cache (an Inf
    # there was NaN activations and an integer overflow in the next layer's sums).
    files.append(_with_half(work, "huge-v-scale.gguf", "blk.0.attn_v.weight", 3, 0, 0x7BFF))
    files.append(_with_half(work, "huge-down-scale.gguf", "blk.0.ffn_down.weight", 0, 0, 0x7BFF))
    files.append(_rewritten(work, "defect-rope-below-1.gguf", fields={"llama.rope.freq_base": (1e-30, f32)}))
    offsets = tensor_offsets(work / "base.gguf")
    misaligned = _copy(work, "defect-misaligned.gguf")
    edit_tensor_info(misaligned, "blk.0.attn_norm.weight", offset=offsets["blk.0.attn_norm.weight"] + 1)
    overlapping = _copy(work, "defect-overlapping.gguf")
    edit_tensor_info(overlapping, "blk.1.ffn_norm.weight", offset=offsets["blk.1.attn_norm.weight"])
    return [*files, misaligned, overlapping]


def k_and_bias_mutations(work: Path) -> list[Path]:
    """The K-quants' super-block scales and mins not finite; Qwen2's biases NaN, short or missing (each
    refused), or F16 (legal: runs)."""
    if "k_quants" in work.name:
        return [
            _with_half(work, "defect-nan-q6_k-d.gguf", "blk.0.ffn_down.weight", 3, 208, 0x7E00),
            _with_half(work, "defect-inf-q4_k-dmin.gguf", "blk.1.ffn_up.weight", 0, 2, 0x7C00),
            _with_half(work, "defect-inf-q5_k-d.gguf", "blk.0.attn_q.weight", 7, 0, 0xFC00),
            _with_half(work, "subnormal-q4_k-d.gguf", "blk.0.attn_k.weight", 1, 0, 0x0001),
        ]
    nan = np.full(64, np.nan, np.float32)
    return [
        _with_half(work, "defect-nan-q5_0-d.gguf", "blk.0.attn_output.weight", 2, 22, 0x7E00),
        _with_half(work, "defect-inf-q5_1-m.gguf", "blk.1.ffn_gate.weight", 5, 2, 0x7C00),
        _rewritten(work, "defect-nan-bias.gguf", tensors={"blk.0.attn_q.bias": nan}),
        _rewritten(work, "defect-short-bias.gguf", tensors={"blk.1.attn_v.bias": np.ones(16, np.float32)}),
        _rewritten(work, "defect-no-bias.gguf", tensors={"blk.0.attn_k.bias": None}),
        _rewritten(work, "f16-bias.gguf", tensors={"blk.1.attn_k.bias": np.ones(32, np.float16)}),
    ]


COUNT_FIELDS = (
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.context_length",
    "llama.rope.dimension_count",
)
FLOAT_FIELDS = ("llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon")
COUNTS = (0, 1, 2, 3, 4, 8, 16, 31, 32, 33, 48, 63, 64, 65, 96, 128, 256, 4096, 2**31 - 1, 2**31, 2**32 + 16)
FLOATS = (0.0, -0.0, 1e-45, 1e-30, 1.0, 1e30, 3.4e38, float("nan"), float("inf"), float("-inf"), -1.0)
HALVES = (0x7C00, 0xFC00, 0x7E00, 0x7BFF, 0x0001, 0x0000, 0x8000)


def random_mutations(work: Path, count: int, seed: int) -> list[Path]:
    """`count` files, each one random change of what the kernels read (seeded: the same files every run)."""
    from gguf import GGUFReader, GGUFValueType

    from engines.native_gguf.contract import BLOCK_BYTES, BLOCK_HALVES
    from tests.support.gguf_writer import edit_tensor_info, tensor_offsets

    rng = random.Random(seed)
    reader = GGUFReader(str(work / "base.gguf"))
    arch = reader.fields["general.architecture"].contents()
    count_fields = [f.replace("llama.", f"{arch}.") for f in COUNT_FIELDS]
    float_fields = [f.replace("llama.", f"{arch}.") for f in FLOAT_FIELDS]
    tensors = {t.name: t for t in reader.tensors}
    names = sorted(tensors)
    offsets = tensor_offsets(work / "base.gguf")
    kinds = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.FLOAT32)
    files = []
    for index in range(count):
        what = rng.choice(("count", "float", "dims", "offset", "half", "norm", "type"))
        name = f"random-{index}-{what}.gguf"
        if what == "count":
            kind = rng.choice(kinds)
            value = rng.choice(COUNTS)
            if kind == GGUFValueType.UINT32:
                value = min(value, 2**32 - 1)
            elif kind == GGUFValueType.INT32:
                value = min(value, 2**31 - 1)
            value = float(value) if kind == GGUFValueType.FLOAT32 else value
            files.append(_rewritten(work, name, fields={rng.choice(count_fields): (value, kind)}))
        elif what == "float":
            kind = rng.choice((GGUFValueType.FLOAT32, GGUFValueType.FLOAT64))
            files.append(_rewritten(work, name, fields={rng.choice(float_fields): (rng.choice(FLOATS), kind)}))
        elif what == "dims":
            target = rng.choice(names)
            dims = [int(d) for d in tensors[target].shape]
            axis = rng.randrange(len(dims))
            dims[axis] = max(0, rng.choice((dims[axis] // 2, dims[axis] * 2, dims[axis] + 32, dims[axis] - 32, 1)))
            path = _copy(work, name)
            edit_tensor_info(path, target, dims=dims)
            files.append(path)
        elif what == "offset":
            target = rng.choice(names)
            choice = rng.choice(("shift", "other", "far"))
            offset = {
                "shift": offsets[target] + rng.choice((1, 2, 16, 31, 32, 64, -32)),
                "other": offsets[rng.choice(names)],
                "far": rng.choice((2**40, 2**63, 10**6)),
            }[choice]
            path = _copy(work, name)
            edit_tensor_info(path, target, offset=max(0, offset))
            files.append(path)
        elif what == "half":
            target = rng.choice([n for n in names if tensors[n].tensor_type.name in BLOCK_BYTES])
            raw, _ = _raw(work, target)
            kind = tensors[target].tensor_type.name
            block = BLOCK_BYTES[kind]
            at = rng.randrange(raw.shape[1] // block) * block + rng.choice(BLOCK_HALVES[kind])
            files.append(_with_half(work, name, target, rng.randrange(raw.shape[0]), at, rng.choice(HALVES)))
        elif what == "norm":
            target = rng.choice([n for n in names if "norm" in n])
            length = rng.choice((0, 1, 16, 63, 65, 128))
            dtype = rng.choice((np.float32, np.float16))
            values = np.full(max(length, 1), rng.choice((1.0, 0.0, 1e4)), dtype)[:length] if length else None
            files.append(_rewritten(work, name, tensors={target: values}))
        else:  # the stored type changed in place (the bytes stay as they are)
            from gguf import GGUFReader as Editable

            target = rng.choice(names)
            path = _copy(work, name)
            info = next(t for t in Editable(str(path), "r+").tensors if t.name == target).field
            info.parts[4][0] = rng.choice((0, 1, 2, 3, 6, 7, 8, 12, 13, 14))  # F32 .. Q8_0, Q4_K, Q5_K, Q6_K
            files.append(path)
    return files
