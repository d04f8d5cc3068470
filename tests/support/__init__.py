"""What the tests share, one copy each:

- cli: `run_optimize` (the command line in a subprocess), `refusal_in_process` (the command line's
  own check of a command that is refused before it runs, in the test process), FAST_OVERRIDES, ROOT,
  and `one_error_line` (exit 2 with a single `error: ...` line on stderr, no traceback);
- shared: `build_once`, a session artifact built once per test run, also across pytest-xdist workers;
- schedule: the order `-n 2 --dist loadfile` hands the files to its workers, longest first by each
  file's recorded seconds (file_seconds.json; `python -m tests.support.schedule JUNIT` rewrites it);
- context: `recipe_context` and its shorthands, the real optimize.context.Context on a plan of a
  composed recipe, which method and task tests hand to a method;
- models: tiny random models (tiny_bert, tiny_llama, tiny_llama_folder) and a stand-in tokenizer;
- tiny_llm: the tiny causal-LM artifact for the serve tests (`python -m tests.support.tiny_llm OUT`);
- serve: a real `python -m serve` subprocess and in-process apps.

Import what a test needs from its module (`from tests.support.cli import run_optimize`): cli, serve
and tiny_llm import no torch at import time; models and context do (and set torch to one thread).
"""
