"""Training: SFT and co-training steps, draft distillation, the run and checkpoints."""
