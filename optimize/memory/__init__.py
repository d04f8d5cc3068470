"""Memory planned, not discovered: the model's size read from its files before anything loads (shape),
each stage's peak estimated from it and the builders' measured bytes per parameter against the memory
this machine lets the run use (plan). Each stage's time and peak memory as the run goes is recorded by
optimize/stages.py (the task modules record their own stages, and the plan reads the sources)."""
