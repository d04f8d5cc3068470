"""`python -m optimize.export ARTIFACT --bundle DIR | --to vllm DIR`: the command line of bundle.py."""

from __future__ import annotations

import sys

from optimize.export.bundle import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
