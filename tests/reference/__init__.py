"""NumPy oracles written from the papers and shared/notes/algorithms.md.

They import neither torch kernels nor tritonkv: inputs are NumPy arrays, outputs NumPy arrays.
"""
