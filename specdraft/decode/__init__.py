"""Decoding: autoregressive generation (speculative decoding joins in a later issue)."""
