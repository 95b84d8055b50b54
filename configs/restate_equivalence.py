"""The drift experiment's A - C reward equivalence, restated under a design with two looks.

Run:   python experiments/restate_equivalence.py --config=configs/restate_equivalence.py \
         --workdir=docs/results/drift_equivalence_restated

The equivalence goal (final reward C - A: its 95% Welch interval within +-0.1, fixed 2026-11-30)
was judged twice on one growing sequence of seeds: at 10 seeds (docs/results/drift: missed) and,
after seeing that, at 20 (docs/results/drift_equivalence, the first 10 seeds restored: met). Two
looks at one claim need a correction. This design (declared 2026-12-04, after both looks were
seen, and so stated) splits alpha = 0.05 evenly over the looks (Bonferroni): each look's interval
is its 97.5% Welch interval, and equivalence holds if any look's lies within +-0.1. The results
files keep only each look's 95% interval, so the 97.5% half-width is bounded from above: the 95%
half-width times t(0.9875, n - 1) / t(0.975, 2n - 2), the Welch degrees of freedom lying between
n - 1 and 2n - 2 for n seeds per arm.
"""

from __future__ import annotations

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.restate = dict(
    looks=("docs/results/drift/results.json", "docs/results/drift_equivalence/results.json"),
    alpha=0.05,
    correction="bonferroni",
    declared="2026-12-04",
    goals=dict(
      equivalent_after_correction=dict(
        metric="ci_abs_max_corrected_min",
        fixed="2026-11-30",
        op="<=",
        target=0.1,
        what="final reward C - A: the Bonferroni-corrected interval (two looks) within +-0.1 "
        "at some look (upper bound on its half-width)",
      ),
    ),
  )
  return c
