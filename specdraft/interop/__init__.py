"""Checkpoints in and out of other formats (Hugging Face)."""
