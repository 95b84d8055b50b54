"""Decoding: autoregressive and speculative generation, lossless rejection sampling."""
