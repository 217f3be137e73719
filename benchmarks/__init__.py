"""Reproducible performance measurements of nw-adapter (run ``python benchmarks/run.py``)."""
