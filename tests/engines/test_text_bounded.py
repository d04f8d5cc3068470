"""engines/text.py: a text is cut to what its first max_length tokens can come from before it is
tokenized, so one huge text (a labeled jsonl row, a request) costs what a short one does."""

import subprocess
import sys

from engines.text import TextEncoder
from tests.support.cli import ROOT
from tests.support.tiny_classifiers import minilm_dir


def test_a_long_text_encodes_as_its_prefix_does():
    encoder = TextEncoder(minilm_dir(), max_length=16)
    words = " ".join(f"word{i}" for i in range(5000))
    whole, prefix = encoder([words]), encoder([words[:200]])
    assert whole["input_ids"].tolist() == prefix["input_ids"].tolist()
    assert whole["input_ids"].shape == (1, 16)


def test_a_huge_text_costs_little_memory():
    # Peak resident memory of a fresh interpreter encoding one 4 MB text, less before: tokenized whole,
    # it took about 170 bytes per character (about 700 MB here).
    code = (
        "import resource, sys\n"
        "from engines.text import TextEncoder\n"
        f"encoder = TextEncoder({str(minilm_dir())!r}, max_length=128)\n"
        "encoder(['warm up'])\n"
        "text = 'lorem ipsum dolor sit amet ' * 150_000\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "encoder([text])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    grown_kib = int(proc.stdout.strip())
    assert grown_kib < 100_000, f"encoding one 4 MB text grew the peak by {grown_kib} KiB"
