"""The benchmark programs, run from the repository root as modules (``python -m benchmarks.speed``); not installed
with the package. Their map: ``docs/benchmarks.md``."""
