"""The quick tests: no venv, no Docker, no pipeline run (`pytest -m "not e2e"` runs these alone, in minutes)."""
