"""submit's own module: the competition's submission API (submission.py)."""
