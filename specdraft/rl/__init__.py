"""Reinforcement learning: GRPO objectives."""
