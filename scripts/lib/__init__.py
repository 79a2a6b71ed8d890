"""Code the stage scripts share. A stage script imports from here, never from another stage script
(tests/test_imports.py checks it); a stage that needs another stage's work runs it as a program.

Importing it puts the project root on sys.path: stages also share the image's own `serving` package (its
settings table, its fp32 products), which must not be copied into here."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
