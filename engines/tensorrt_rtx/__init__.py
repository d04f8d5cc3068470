"""TensorRT-RTX: ahead-of-time plans built in a child process, and the plan runner."""
