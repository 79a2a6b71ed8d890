"""quantize's own modules: its guards before and after (checks.py) and vocabulary pruning (vocab.py)."""
