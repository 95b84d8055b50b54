"""Fused attention kernels (Pallas): one block of packed, masked attention, forward and backward.

`flash.block_attention` has the interface of `blockwise.blk` (the XLA tiles): (q, k, v, query
rows, key rows) -> (out, lse), differentiable, with its backward in Pallas from (dout, dlse,
out, lse). On CPU it runs in Pallas interpret mode; on GPU it lowers through Triton and on TPU
through Mosaic. `ring.ring_attention_shard` is the context-parallel ring over it.
"""

from specdraft.attention.kernels.flash import (
  KernelSettings,
  block_attention,
  block_attention_bwd,
  block_attention_fwd,
  resolve_backend,
)

__all__ = [
  "KernelSettings",
  "block_attention",
  "block_attention_bwd",
  "block_attention_fwd",
  "resolve_backend",
]
