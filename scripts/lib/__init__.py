"""Everything the stage scripts import, kept out of the scripts themselves, laid out by who uses it:

- here at the top: code several stages share (stage.py, containers.py, probe.py, ...);
- dag/: what rules/common.smk runs while the DAG is built (the config's checks, sweeps, the lock, select's ranking,
  each rule's code inputs), which stages may import too;
- <stage>/, named for the stage script that alone imports it: a stage's own larger parts, kept apart so its script
  stays a thin main (load_probe/, submit/, quantize/, base_image/, make_venv/, bake_compile_cache/);
- tiny/: the tiny profile's model and its quality tasks' data.

Which rule runs a module is read from the imports (dag/imports.py lists them as inputs of each rule), not from where it
sits here. The rules (tests/unit/test_imports.py): a stage script imports from here, never from another stage script (a
stage that needs another stage's work runs it as a program), and only the stage a <stage>/ package is named for
imports it.

Importing it puts the project root on sys.path: stages also share the image's own `serving` package (its
settings table, its fp32 products), which must not be copied into here."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
