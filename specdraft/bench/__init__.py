"""Benchmarks behind the thin entry points in experiments/."""
