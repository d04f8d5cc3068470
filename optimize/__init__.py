"""Gated model optimization: recipe -> optimized artifact -> evaluated against its baseline -> verdict."""

__version__ = "0.1.0"

# Exit codes CI can rely on.
EXIT_PASSED = 0
EXIT_GATE_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL_ERROR = 3
EXIT_SIGINT, EXIT_SIGTERM = 130, 143  # interrupted by Ctrl-C / stopped by SIGTERM: nothing written
