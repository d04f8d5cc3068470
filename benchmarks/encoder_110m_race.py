"""The default encoder recipe on a 110M-parameter sentence encoder of another architecture than MiniLM's:
a random-weight MPNet of all-mpnet-base-v2's shape (768 wide, 12 layers, 12 heads, 3072 ffn) written as
a sentence-transformers folder with MiniLM's tokenizer (its vocabulary, 30522, sizes the embedding),
since the real checkpoint does not install offline. Random weights time the same as trained ones; the
accuracy figures are not a trained model's.

    python -m benchmarks.encoder_110m_race FOLDER            # write the folder
    /usr/bin/time -v python -m optimize recipe=minilm_int8_cpu model.source=FOLDER
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    from tests.support.tiny_archs import MPNET_BASE, encoder_folder

    if len(argv) != 1:
        print("usage: python -m benchmarks.encoder_110m_race FOLDER", file=sys.stderr)
        return 2
    out = encoder_folder("mpnet", Path(argv[0]), MPNET_BASE)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
