"""Parallelism: meshes, named layouts (model-agnostic)."""
