"""The trainers that make this project's own models from its calibration data: the docstring classifier, the
digits CNN and a small Llama (each `python -m optimize.train.NAME`)."""
