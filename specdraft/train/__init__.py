"""Training: steps, loops and checkpoints."""
