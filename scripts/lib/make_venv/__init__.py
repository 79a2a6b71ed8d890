"""make_venv's own module (rule venv): packages built from source where PyPI has no usable wheel (local_builds.py)."""
