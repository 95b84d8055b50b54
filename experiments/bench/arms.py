"""The drift experiment's arms by name, for printouts, plots and docs/results.md (kept apart from
`bench/drift.py` so the renderer reads them without importing the training stack)."""

# an arm: `<rollout.draft>` or `<rollout.draft>_<kind>` (bench/drift.py `parse_arm`)
ARM_NAMES = {
  "none": "A: AR rollouts",
  "fixed": "B: SD, fixed draft",
  "cotrained": "C: SD, co-trained draft",
  "cotrained_dflash": "D: SD, co-trained DFlash",
  "cotrained_dspark": "E: SD, co-trained DSpark",
  "fixed_dflash": "SD, fixed DFlash",
  "fixed_dspark": "SD, fixed DSpark",
}
