"""Models: the policy LM (policy.py), the EAGLE-3 draft (eagle3.py) and the pipelined policy."""
