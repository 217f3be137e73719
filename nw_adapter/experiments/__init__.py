"""Synthetic and real-feature experiments of the paper (THEORY.md section 5)."""
