"""The lab notebook: entry points (experiments/*.py, each with its config in configs/), the
benchmark bodies behind them (experiments/bench/) and the renderer of docs/results.md. Not part of
the installed library: `specdraft` never imports from here."""
