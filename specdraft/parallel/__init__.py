"""Parallelism (model-agnostic): named layouts, meshes, zigzag CP token order, GPipe, TapChannel."""
