"""specdraft: online draft co-training for speculative decoding in RL post-training (JAX).

See README.md to run it and docs/design.md for the design.
"""
