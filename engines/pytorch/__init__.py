"""PyTorch: the FP32 baseline, the CUDA runners and kernels, and the checkpoint engines measured in PyTorch."""
