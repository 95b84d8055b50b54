"""Parallelism (model-agnostic): named layouts, meshes, zigzag CP layout, GPipe, TapChannel."""
