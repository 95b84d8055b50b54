"""Benchmark bodies behind the thin entry points in experiments/ (kept out of the library)."""
