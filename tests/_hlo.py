"""Reading compiled programs in tests."""

import re

import numpy as np

_ARRAY = re.compile(r"\b(?:f64|f32|bf16|f16|s64|s32|u32|s8|u8|pred)\[([\d,]*)\]")


def largest_array(hlo_text: str) -> int:
  """The largest element count of any array shape in an HLO module's text (every instruction,
  fused ones included: an upper bound on what the program materialises)."""
  return max(
    int(np.prod([int(d) for d in dims.split(",") if d])) for dims in _ARRAY.findall(hlo_text)
  )
