"""NumPy oracles written from the papers and docs/algorithms.md.

They import neither torch kernels nor tritonkv: inputs are NumPy arrays, outputs NumPy arrays.
"""
