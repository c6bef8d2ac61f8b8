"""Measurements of inferfleet, run from the repo root: ``python -m benchmarks.bench_cpu ...``.

Each module imports the installed package; figures go to docs/benchmarks.md.
"""
