"""Everything the stage scripts import, kept out of the scripts themselves: code several stages share (stage.py,
containers.py, probe.py, ...); a stage's own larger parts, kept apart so its script stays a thin main (load.py is
load_probe's, submission.py submit's, quantize_checks.py quantize's); the tiny model's code (tiny/); and what
rules/common.smk runs while the DAG is built (config.py, sweeps.py, selection.py, lock.py, imports.py). Which stage
uses a module is read from the imports (imports.py lists them as inputs of each rule), not from where it sits here.

The one rule: a stage script imports from here, never from another stage script (tests/test_imports.py checks it); a
stage that needs another stage's work runs it as a program.

Importing it puts the project root on sys.path: stages also share the image's own `serving` package (its
settings table, its fp32 products), which must not be copied into here."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
