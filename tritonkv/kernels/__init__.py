"""Triton kernels and their launchers, one module per kernel family."""
