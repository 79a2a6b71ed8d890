"""The gate's tasks as lm-eval resolves them (its own tasks plus the profile's tasks_dir): read by quality_gate, and by
download_datasets to fetch the hub datasets those tasks load."""

import sys
from pathlib import Path


def task_manager(tasks_dir: str | None):
    from lm_eval.tasks import TaskManager

    # lm-eval imports the tasks' utils.py; a __pycache__ there would change the rule's set of input files
    sys.dont_write_bytecode = True
    return TaskManager(include_path=str(Path(tasks_dir).resolve()) if tasks_dir else None)
