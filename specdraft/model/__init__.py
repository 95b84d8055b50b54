"""Models: the policy LM (drafts join in later issues)."""
