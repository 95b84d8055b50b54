"""Which keys each query sees, for the policy's trunk and each draft kind's branch, read off the
attention oracle itself (`attention/reference.py::branch_attention_dense`): every key carries a
one-hot value and every query a zero vector, so a query's output is the mean of the one-hot
values it can see, and its nonzero entries are its visible keys.

`python experiments/plot_masks.py --out=docs/figures/masks.png` draws the three side by side for
one packed row (two documents).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specdraft.attention import reference


def visibility(segment_ids, W: int, branch: str):
  """Boolean visibility of one row: (trunk [S, S], branch [S*W, S + S*W]): query rows against
  the trunk keys, then every anchor's W branch keys (anchor-major)."""
  seg = jnp.asarray(segment_ids, jnp.int32)[None]
  S = seg.shape[1]
  n = S + S * W
  eye = jnp.eye(n, dtype=jnp.float32)
  v = eye[:S][None, :, None, :]  # [1, S, K=1, D=n]: trunk key s carries one-hot s
  v_br = eye[S:].reshape(1, S, W, 1, n)  # branch key (t, i) carries one-hot S + t*W + i
  q = jnp.zeros((1, S, 1, n))
  q_br = jnp.zeros((1, S, W, 1, n))
  k, k_br = jnp.zeros_like(v), jnp.zeros_like(v_br)
  out, out_br, _, _ = reference.branch_attention_dense(
    q, k, v, q_br, k_br, v_br, seg, branch=branch
  )
  trunk = np.asarray(out[0, :, 0, :S]) > 0
  br = np.asarray(out_br[0, :, :, 0, :]).reshape(S * W, n) > 0
  return trunk, br


def plot(path: str, segment_ids=(1, 1, 1, 1, 2, 2, 2), W: int = 3) -> dict:
  """Writes the picture; returns the visibility matrices it shows."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  S = len(segment_ids)
  trunk, ttt = visibility(segment_ids, W, "ttt")
  _, block = visibility(segment_ids, W, "block")
  fig, axes = plt.subplots(
    1, 3, figsize=(15, 5), gridspec_kw={"width_ratios": [S, S + S * W, S + S * W]}
  )
  panels = (
    (trunk, "trunk: s <= t\n(policy; EAGLE-3 step 0)", [f"t{t}" for t in range(S)]),
    (ttt, f"EAGLE-3 TTT branch, W={W}: s <= t, own steps i <= j", None),
    (block, f"DFlash / DSpark block, W={W}: s < t, whole own block", None),
  )
  branch_rows = [f"({t},{j})" for t in range(S) for j in range(W)]
  cols = [f"s{s}" for s in range(S)] + [f"({t},{i})" for t in range(S) for i in range(W)]
  for ax, (m, title, rows) in zip(axes, panels):
    ax.imshow(m, cmap="Greys", vmin=0, vmax=1.4, aspect="auto", interpolation="nearest")
    ax.set_title(title, fontsize=9)
    labels = rows or branch_rows
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    names = cols[: m.shape[1]]
    ax.set_xticks(range(len(names)), names, fontsize=5, rotation=90)
    if m.shape[1] > S:
      ax.axvline(S - 0.5, color="tab:red", lw=1)
    ax.set_xlabel("keys: trunk s | branch (anchor, entry)", fontsize=7)
  fig.suptitle(f"who sees whom in one packed row (segments {list(segment_ids)}; black = visible)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return {"trunk": trunk, "ttt": ttt, "block": block}
