"""load_probe's own module: the request mix and the verdict on what came back (load.py)."""
