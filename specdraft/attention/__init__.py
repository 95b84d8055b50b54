"""Attention: the dense oracle and the public `branch_attention` entry point."""

from specdraft.attention.api import branch_attention
from specdraft.attention.reference import (
  branch_attention_dense,
  causal_attention,
  causal_mask,
  masked_attention,
)

__all__ = [
  "branch_attention",
  "branch_attention_dense",
  "causal_attention",
  "causal_mask",
  "masked_attention",
]
