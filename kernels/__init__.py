"""Triton kernels for the CUDA serving path, each with a plain-torch reference."""
